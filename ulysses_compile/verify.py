"""Checks against eager execution: ``options={"verify": True}`` (a compiled graph's first call) and the
comparison table that it and ``python -m ulysses_compile verify`` print."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ulysses_compile.agreement import input_names
from ulysses_compile.core.boundary import computed_outputs
from ulysses_compile.core.collectives import average_grad, gather_objects, mean_over_group, take_block
from ulysses_compile.core.compat import _resolve_process_group, bind_symbols, guards_hold, symbolic_expr
from ulysses_compile.core.errors import OptionsError, VerificationError
from ulysses_compile.core.random_draws import random_draw
from ulysses_compile.core.report import module_path
from ulysses_compile.core.sharding import seq_factors, sharding_of
from ulysses_compile.core.sizes import is_symbolic

log = logging.getLogger("ulysses_compile")

RTOL = 1e-4


def compare(name_pairs, rtol: float = RTOL) -> tuple[list[str], bool]:
    """Rows of a table (name, max abs error, error relative to the reference's magnitude) and a verdict."""
    rows, ok = [], True
    for name, got, want in name_pairs:
        if got is None or want is None:
            rows.append(f"{name:<40} {'compiled' if got is None else 'eager'} has none   MISMATCH")
            ok = False
            continue
        if got.shape != want.shape:
            rows.append(f"{name:<40} shape {tuple(got.shape)} != {tuple(want.shape)}   MISMATCH")
            ok = False
            continue
        got64, want64 = got.detach().double(), want.detach().double()
        same = (got64 == want64) | (got64.isnan() & want64.isnan())  # a NaN or inf where eager has it
        error = (got64 - want64).abs().masked_fill(same, 0).max().item() if got.numel() else 0.0
        scale = want64.abs().masked_fill(~want64.isfinite(), 0).max().item() if want.numel() else 0.0
        relative = error / scale if scale else error
        bad = not relative <= rtol
        ok = ok and not bad
        rows.append(f"{name:<40} max abs {error:.3e}   rel {relative:.3e}" + ("   MISMATCH" if bad else ""))
    return rows, ok


def verified(compiled, original, gm: fx.GraphModule, ctx):
    """``compiled`` checked on its first call against ``original`` (the captured graph) run eagerly. An
    output the rewritten graph leaves sequence-sharded (``outputs="local"``) is compared with this
    rank's block of the eager one."""
    checked = False
    blocks = _output_blocks(gm)
    computed = gm.meta["ulysses_report"].computed_outputs

    def run(*args):
        nonlocal checked
        result = compiled(*args)
        if not checked:
            checked = True
            with torch.no_grad():  # on copies: the graph may update buffers in place
                reference = original(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
                got = computed_outputs(result, computed)
            reference = [_this_ranks(want, block, ctx) for want, block in zip(reference, blocks, strict=True)]
            pairs = [(f"output {name}", got, want)
                     for (name, got), (_, want) in zip(named_tensors(got), named_tensors(reference))]
            rows, ok = compare(pairs)
            if not ok:
                raise VerificationError(
                    f"rank {ctx.rank}: the compiled graph disagrees with eager execution "
                    f"(rtol {RTOL} of the reference's magnitude):\n" + "\n".join(rows)
                )
        return result

    return run


def _this_ranks(whole, block, ctx):
    """This rank's block of an eager output the rewritten graph leaves sequence-sharded (``block``:
    ``(dim, outer, inner, head_tail)``); anything else as it is."""
    if block is None or not isinstance(whole, torch.Tensor):
        return whole
    dim, outer, inner, head_tail = block
    return take_block(whole, dim, outer, inner, ctx.rank, ctx.world_size, head_tail)


def _output_blocks(gm: fx.GraphModule) -> list[tuple[int, int, int, int] | None]:
    """For each output of the captured graph, ``(dim, outer, inner, head_tail)`` of its sequence sharding
    if the rewritten graph leaves it sharded, else None."""
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0]
    report = gm.meta["ulysses_report"]
    blocks = []
    for arg in values[:len(values) - len(report.computed_outputs)]:
        sharding = sharding_of(arg) if isinstance(arg, fx.Node) else None
        placement = sharding.output if sharding is not None else None
        factors = None if placement is None or isinstance(placement, tuple) else seq_factors(placement)
        blocks.append(None if factors is None else (*factors, report.head_tail))
    return blocks


def named_tensors(output, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in a model's output (a tensor, tuple, list, dict or transformers ModelOutput), named
    by their path in it: ``loss``, ``logits``, ``0``, ``hidden_states.2``. A DTensor is gathered whole
    (``full_tensor``, differentiable), as eager holds it."""
    if isinstance(output, DTensor):
        output = output.full_tensor()
    if isinstance(output, torch.Tensor):
        return [(prefix or "output", output)]
    if isinstance(output, dict):
        items = output.items()
    elif isinstance(output, (tuple, list)):
        items = enumerate(output)
    else:
        return []
    return [pair for key, value in items for pair in named_tensors(value, f"{prefix}.{key}" if prefix else str(key))]


def differentiable_scalar(output) -> torch.Tensor | None:
    """What to call ``backward`` on: the output's ``loss`` if it has one, else every floating output
    that requires grad, weighted by fixed random numbers (a plain sum would give every element the
    same gradient and hide a permutation) and summed; None when nothing requires grad."""
    loss = output.get("loss") if isinstance(output, dict) else None
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss.float().sum()
    terms = []
    generator = torch.Generator().manual_seed(0)
    for _, tensor in named_tensors(output):
        if tensor.requires_grad and tensor.is_floating_point():
            weights = torch.randn(tensor.shape, generator=generator).to(tensor.device)
            terms.append((tensor.float() * weights).sum())
    return torch.stack(terms).sum() if terms else None


def verified_short(compiled, original, gm: fx.GraphModule, ctx, example_inputs):
    """``compiled`` checked once, before its first call runs, on a short sequence: the same compiled
    program and ``original`` run eagerly on the first ``S'`` positions of every input, where ``S'`` is
    the shortest length of the call's class (``S mod P`` kept, at least ``2P``) that the graph's shape
    guards accept; outputs and, when gradients are enabled, the gradients of every input that requires
    them (parameters, and activations from an earlier graph) are compared. The check costs a forward
    and backward at ``S'`` tokens in each of the two programs, so it runs at any real length, where an
    eager step at ``S`` would not fit. It needs the length symbolic (``torch.compile(...,
    dynamic=True)``): a graph compiled for one length cannot run another."""
    report = gm.meta["ulysses_report"]
    if report.replicated:
        report.notes.append("verify='short': the graph runs replicated, as eager does; nothing to check")
        return compiled
    if any(site.on_cache_heads for site in report.attention_sites):
        report.notes.append("verify='short': a decoding step over a key/value cache (no sequence is split, so "
                            "there is no shorter one to run); nothing to check")
        return compiled
    lengths = [length for site in report.attention_sites for length in (site.seq_len, site.kv_seq_len)]
    static = [length for length in lengths if not is_symbolic(length)]
    if static:
        raise OptionsError(
            f"option verify='short' runs the compiled program on a short sequence, but this graph was compiled "
            f"for sequence length {static[0]} only (a static shape); compile with a symbolic length: "
            f"torch.compile(model, backend='ulysses', dynamic=True, options={{'verify': 'short'}})"
        )
    random = _random_draw(original)
    if random is not None:
        _skipped(report, f"the graph draws random numbers ({random}), which the compiled program and eager "
                         f"draw differently; verify with dropout off (model.eval())")
        return compiled
    placeholders = gm.graph.find_nodes(op="placeholder")
    check = _ShortCheck(
        compiled=lambda *args: computed_outputs(compiled(*args), report.computed_outputs), original=original, ctx=ctx, report=report, size=lengths[0],
        symbols=sorted(set().union(*(symbolic_expr(length).free_symbols for length in lengths)), key=str),
        inputs=[_placeholder_value(node, example) for node, example in zip(placeholders, example_inputs)],
        names=input_names(gm), blocks=_output_blocks(gm),
        by_reference={i for i, node in enumerate(placeholders)
                      if node in ctx.parameters and "_buffers_" not in node.target},
        averaged={i for i, node in enumerate(placeholders) if any(user.target is average_grad for user in node.users)},
    )
    checked = False

    def run(*args):
        nonlocal checked
        if not checked:
            checked = True
            check(args)
        return compiled(*args)

    return run


def _skipped(report, reason: str) -> None:
    log.warning("ulysses_compile: verify='short' skipped: %s", reason)
    report.notes.append(f"verify='short' skipped: {reason}")


def _placeholder_value(node: fx.Node, example):
    """What a graph input is with its symbolic sizes (Dynamo hands the backend real example tensors)."""
    value = node.meta.get("example_value", example)
    return value if isinstance(value, (torch.Tensor, torch.SymInt)) else None


@dataclass
class _ShortCheck:
    compiled: object
    original: fx.GraphModule
    ctx: object
    report: object
    size: torch.SymInt  # a symbolic size of the graph: its shape environment
    symbols: list  # the sequence lengths' size symbols
    inputs: list  # each graph input with its symbolic sizes (None: not a tensor or SymInt)
    names: list[str]
    blocks: list  # each output's sequence sharding, if it leaves the graph sharded
    by_reference: set[int]  # parameters and ZeRO shards: passed as they are, never copied
    averaged: set[int]  # parameters whose gradient the rewrite averages over data-parallel replicas

    def __call__(self, args) -> None:
        group = _resolve_process_group(self.ctx.group_name)
        values = bind_symbols(self.size, self.inputs, args)
        short = self._short_lengths(args, values)
        chosen = gather_objects(short, group)
        if short is None or any(other != short for other in chosen):
            reason = (f"no length shorter than {', '.join(str(values[s]) for s in self.symbols)} passes the "
                      f"graph's shape guards on every rank")
            _skipped(self.report, reason)
            return
        at = ", ".join(f"{short[str(s)]} (this call {values[s]})" for s in self.symbols)
        started = time.perf_counter()
        failure, rows, counts = None, [], (0, 0)
        try:
            rows, counts = self._compare({**values, **{s: short[str(s)] for s in self.symbols}}, args)
        except Exception as raised:  # every rank must reach the verdict below, or the others would wait
            failure = raised
        verdicts = gather_objects(failure is None and not any("MISMATCH" in row for row in rows), group)
        failing = [rank for rank, ok in enumerate(verdicts) if not ok]
        if failing:
            detail = "\n".join(rows) if rows else f"the check raised {type(failure).__name__}: {failure}"
            raise VerificationError(
                f"rank {self.ctx.rank}: at the short sequence length {at} the compiled graph disagrees with "
                f"eager execution on ranks {failing} (rtol {RTOL} of the reference's magnitude); this rank:\n"
                + detail
            ) from failure
        note = (f"verify='short': at sequence length {at} the compiled program's {counts[0]} outputs and "
                f"{counts[1]} gradients match eager")
        seconds = time.perf_counter() - started
        log.info("ulysses_compile: %s (%.2f s)", note, seconds, extra={"verify_seconds": seconds})
        self.report.notes.append(note)

    def _short_lengths(self, args, values: dict, tries: int = 64) -> dict | None:
        """The shortest lengths of the call's class (each ``S mod P`` kept, at least ``2P``) under which
        every guard holds: the call's own lengths only when they are the shortest of their class."""
        world_size = self.ctx.world_size
        for step in range(tries):
            short = {s: min(values[s], 2 * world_size + values[s] % world_size + step * world_size)
                     for s in self.symbols}
            if step and all(short[s] == values[s] for s in self.symbols):
                return None
            shapes = [torch.empty_strided(*_sizes(example, {**values, **short}), device="meta")
                      if isinstance(example, torch.Tensor) else _at(example, {**values, **short})
                      for example in self.inputs]
            if guards_hold(self.size, self.inputs, [a if e is None else v for e, a, v in
                                                    zip(self.inputs, args, shapes)]):
                return {str(s): value for s, value in short.items()}
        return None

    def _compare(self, values: dict, args) -> tuple[list[str], tuple[int, int]]:
        differentiate = torch.is_grad_enabled()
        cuda = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda):
            got_inputs = self._shortened(args, values)
            got = list(self.compiled(*got_inputs))
            want_inputs = self._shortened(args, values)
            whole = list(self.original(*want_inputs))
        want = [_this_ranks(w, block, self.ctx) for w, block in zip(whole, self.blocks, strict=True)]
        got_named, want_named = named_tensors(got), named_tensors(want)
        if len(got_named) != len(want_named) or len(got) != len(whole):
            return [f"outputs: the compiled graph returns {len(got_named)} tensors, eager {len(want_named)}   "
                    f"MISMATCH"], (0, 0)
        pairs = [(f"output {name}", g, w) for (name, g), (_, w) in zip(got_named, want_named, strict=True)]
        rows, got_terms, want_terms = [], [], []
        generator = torch.Generator().manual_seed(0)
        for index, (g, w, block) in enumerate(zip(got, whole, self.blocks, strict=True)):
            if not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and w.is_floating_point()):
                continue
            if g.requires_grad != w.requires_grad:
                rows.append(f"output {index}: requires grad {g.requires_grad}, eager {w.requires_grad}   MISMATCH")
            elif w.requires_grad:
                weight = torch.randn(w.shape, generator=generator).to(w.device)
                local = _this_ranks(weight, block, self.ctx)
                got_terms.append((g.float() * local).sum())
                want_terms.append((w.float() * weight).sum())
        targets = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad] \
            if differentiate and got_terms else []
        if targets:
            got_grads = torch.autograd.grad(sum(got_terms), [got_inputs[i] for i in targets], allow_unused=True)
            want_grads = torch.autograd.grad(sum(want_terms), [want_inputs[i] for i in targets], allow_unused=True)
            for i, g, w in zip(targets, got_grads, want_grads, strict=True):
                if w is not None and i in self.averaged:
                    w = mean_over_group(w, *self.ctx.data_parallel)
                if g is not None or w is not None:
                    pairs.append((f"grad {self.names[i]}", g, w))
        compared, _ = compare(pairs)
        gradients = sum(name.startswith("grad ") for name, _, _ in pairs)
        return rows + compared, (len(pairs) - gradients, gradients)

    def _shortened(self, args, values: dict) -> list:
        """``args`` at the sizes ``values`` give the inputs' symbolic sizes and strides: the leading
        positions of each input, as a new leaf (``requires_grad`` kept), and a copy of every other
        tensor but parameters and ZeRO shards (the graph may write buffers in place)."""
        shortened = []
        for index, (example, arg) in enumerate(zip(self.inputs, args, strict=True)):
            if isinstance(example, torch.SymInt):
                shortened.append(_at(example, values))
            elif not isinstance(arg, torch.Tensor) or index in self.by_reference or example is None:
                shortened.append(arg)
            else:
                sizes, strides = _sizes(example, values)
                with torch.no_grad():
                    copy = torch.empty_strided(sizes, strides, dtype=arg.dtype, device=arg.device)
                    copy.copy_(arg[tuple(slice(0, size) for size in sizes)])
                shortened.append(copy.requires_grad_(arg.requires_grad))
        return shortened


def _at(size, values: dict):
    """A size at the symbol values ``values``."""
    if not is_symbolic(size):
        return size
    return int(symbolic_expr(size).xreplace({symbol: sympy.Integer(value) for symbol, value in values.items()}))


def _sizes(example: torch.Tensor, values: dict) -> tuple[list[int], list[int]]:
    return [_at(size, values) for size in example.shape], [_at(stride, values) for stride in example.stride()]


def _random_draw(gm: fx.GraphModule) -> str | None:
    """The first op of a graph (and of its checkpointed bodies) that draws random numbers, described
    with where it is, or None."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if (drawn := random_draw(node)) is not None:
                    return f"{drawn} at {module_path(node) or node.name}"
    return None
