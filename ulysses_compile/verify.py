"""Checks against eager execution: ``options={"verify": True}`` (a compiled graph's first call) and the
comparison table that it and ``python -m ulysses_compile verify`` print."""

from __future__ import annotations

import inspect
import logging

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from .agreement import input_names
from .collectives import take_block
from .compat import shape_guards, symbolic_expr
from .errors import OptionsError, VerificationError
from .report import module_path
from .sharding import seq_factors, sharding_of
from .sizes import is_symbolic

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

    def run(*args):
        nonlocal checked
        result = compiled(*args)
        if not checked:
            checked = True
            with torch.no_grad():  # on copies: the graph may update buffers in place
                reference = original(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            reference = [want if block is None or not isinstance(want, torch.Tensor)
                         else take_block(want, *block, ctx.rank, ctx.world_size)
                         for want, block in zip(reference, blocks, strict=True)]
            pairs = [(f"output {name}", got, want)
                     for (name, got), (_, want) in zip(named_tensors(list(result)), named_tensors(reference))]
            rows, ok = compare(pairs)
            if not ok:
                raise VerificationError(
                    f"rank {ctx.rank}: the compiled graph disagrees with eager execution "
                    f"(rtol {RTOL} of the reference's magnitude):\n" + "\n".join(rows)
                )
        return result

    return run


def _output_blocks(gm: fx.GraphModule) -> list[tuple[int, int, int] | None]:
    """For each output of the rewritten graph, ``(dim, outer, inner)`` of its sequence sharding if it
    leaves the graph sharded, else None."""
    (output,) = gm.graph.find_nodes(op="output")
    blocks = []
    for arg in output.args[0]:
        sharding = sharding_of(arg) if isinstance(arg, fx.Node) else None
        placement = sharding.output if sharding is not None else None
        blocks.append(None if placement is None or isinstance(placement, tuple) else seq_factors(placement))
    return blocks


def named_tensors(output, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in a model's output (a tensor, tuple, list, dict or transformers ModelOutput), named
    by their path in it: ``loss``, ``logits``, ``0``, ``hidden_states.2``."""
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
    the shortest length of the call's class (``S' = S mod P``, at least ``2P``) that the graph's shape
    guards accept; outputs and, when gradients are enabled, every parameter's gradient are compared.
    The check costs a forward and backward at ``S'`` tokens in each of the two programs, so it runs at
    any real length, where an eager step at ``S`` would not fit. It needs the length symbolic
    (``torch.compile(..., dynamic=True)``): a graph compiled for one length cannot run another."""
    report = gm.meta["ulysses_report"]
    if report.replicated:
        report.notes.append("verify='short': the graph runs replicated, as eager does; nothing to check")
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
        return _unchecked(compiled, report, f"the graph draws random numbers ({random}), which the compiled "
                          f"program and eager draw differently; verify with dropout off (model.eval())")
    symbols = sorted(set().union(*(symbolic_expr(length).free_symbols for length in lengths)), key=str)
    guards = shape_guards(lengths[0])
    placeholders = gm.graph.find_nodes(op="placeholder")
    parameters = [i for i, node in enumerate(placeholders) if node in ctx.parameters]
    symbolic_inputs = [node.meta.get("example_value", example) for node, example in zip(placeholders, example_inputs)]
    blocks, names = _output_blocks(gm), input_names(gm)
    checked = False

    def run(*args):
        nonlocal checked
        if not checked:
            checked = True
            values = _bound_symbols(symbolic_inputs, args)
            short = _short_lengths(symbols, values, guards, ctx.world_size)
            if short is None:
                log.warning("ulysses_compile: verify='short' skipped: no length shorter than %s passes the "
                            "graph's shape guards", {str(s): values[s] for s in symbols})
                report.notes.append("verify='short' skipped: no shorter length passes the graph's shape guards")
            else:
                lengths = ", ".join(f"{short[s]} (this call {values[s]})" for s in symbols)
                _check_short(compiled, original, symbolic_inputs, args, {**values, **short}, lengths, parameters,
                             blocks, names, ctx, report)
        return compiled(*args)

    return run


def _unchecked(compiled, report, reason: str):
    log.warning("ulysses_compile: verify='short' skipped: %s", reason)
    report.notes.append(f"verify='short' skipped: {reason}")
    return compiled


def _check_short(compiled, original, symbolic_inputs, args, values: dict, lengths: str, parameters: list[int],
                 blocks, names, ctx, report) -> None:
    kept = [(names[i], args[i]) for i in parameters
            if torch.is_grad_enabled() and isinstance(args[i], torch.Tensor) and args[i].requires_grad]
    with torch.random.fork_rng(devices=[]):
        got = list(compiled(*_shortened(symbolic_inputs, args, values, parameters)))
        whole = list(original(*_shortened(symbolic_inputs, args, values, parameters)))
    want = [w if block is None or not isinstance(w, torch.Tensor) else take_block(w, *block, ctx.rank, ctx.world_size)
            for w, block in zip(whole, blocks, strict=True)]
    pairs = [(f"output {name}", g, w) for (name, g), (_, w) in zip(named_tensors(got), named_tensors(want))]
    got_terms, want_terms = [], []
    generator = torch.Generator().manual_seed(0)
    for g, w, block in zip(got, whole, blocks):
        if all(isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point() for t in (g, w)):
            weight = torch.randn(w.shape, generator=generator).to(w.device)
            local = weight if block is None else take_block(weight, *block, ctx.rank, ctx.world_size)
            got_terms.append((g.float() * local).sum())
            want_terms.append((w.float() * weight).sum())
    if kept and got_terms:
        tensors = [tensor for _, tensor in kept]
        got_grads = torch.autograd.grad(sum(got_terms), tensors, allow_unused=True)
        want_grads = torch.autograd.grad(sum(want_terms), tensors, allow_unused=True)
        pairs += [(f"grad {name}", g, w) for (name, _), g, w in zip(kept, got_grads, want_grads)
                  if g is not None or w is not None]
    rows, ok = compare(pairs)
    if not ok:
        raise VerificationError(
            f"rank {ctx.rank}: at the short sequence length {lengths} the compiled graph disagrees with eager execution "
            f"(rtol {RTOL} of the reference's magnitude):\n" + "\n".join(rows)
        )
    gradients = sum(name.startswith("grad ") for name, _, _ in pairs)
    note = (f"verify='short': at sequence length {lengths} the compiled program's {len(pairs) - gradients} outputs and "
            f"{gradients} parameter gradients match eager")
    log.info("ulysses_compile: %s", note)
    report.notes.append(note)


def _bound_symbols(example_inputs, args) -> dict:
    """Each size symbol that is a whole size of an input (``s27``, not ``s27 + 1``) and its value in ``args``."""
    values = {}
    for example, arg in zip(example_inputs, args):
        pairs = zip(example.shape, arg.shape) if isinstance(example, torch.Tensor) else [(example, arg)]
        for size, value in pairs:
            if is_symbolic(size) and symbolic_expr(size).is_Symbol:
                values[symbolic_expr(size)] = int(value)
    return values


def _short_lengths(symbols, values: dict, guards, world_size: int, tries: int = 64) -> dict | None:
    """The shortest lengths of the call's class (each ``S mod P`` kept, at least ``2P``, at most the call's)
    under which every guard holds, or None."""
    for step in range(tries):
        short = {s: min(values[s], 2 * world_size + values[s] % world_size + step * world_size) for s in symbols}
        at = {**values, **short}
        if all(_holds(guard, at) for guard in guards):
            return short
        if short == {s: values[s] for s in symbols}:
            return None
    return None


def _holds(guard, values: dict) -> bool:
    """False only when the guard is decided and false at ``values`` (a guard on a symbol not bound here,
    such as a data-dependent size, cannot be decided and is not held against the length)."""
    decided = guard.xreplace({symbol: sympy.Integer(value) for symbol, value in values.items()})
    return not (decided.is_Boolean and not bool(decided)) if decided.free_symbols == set() else True


def _shortened(example_inputs, args, values: dict, parameters: list[int]) -> list:
    """``args`` at the sizes ``values`` give the example inputs' symbolic sizes and strides: the leading
    positions of each shortened tensor, and a fresh copy of every other tensor but parameters (the
    graph may write its inputs in place)."""
    substitute = {symbol: sympy.Integer(value) for symbol, value in values.items()}

    def at(size):
        return int(symbolic_expr(size).xreplace(substitute)) if is_symbolic(size) else size

    shortened = []
    for index, (example, arg) in enumerate(zip(example_inputs, args)):
        if is_symbolic(example):
            shortened.append(at(example))
        elif not isinstance(arg, torch.Tensor) or index in parameters:
            shortened.append(arg)
        else:
            sizes = [at(size) for size in example.shape]
            copy = torch.empty_strided(sizes, [at(stride) for stride in example.stride()], dtype=arg.dtype,
                                       device=arg.device)
            shortened.append(copy.copy_(arg[tuple(slice(0, size) for size in sizes)]))
    return shortened


_RANDOM_FUNCTIONS = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
                     torch.bernoulli, torch.multinomial, torch.normal, torch.randperm, torch.poisson}
_RANDOM_METHODS = {"uniform_", "normal_", "bernoulli", "bernoulli_", "exponential_", "geometric_", "log_normal_",
                   "cauchy_", "random_"}
_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)


def _random_draw(gm: fx.GraphModule) -> str | None:
    """The first op of the captured graph that draws random numbers (a dropout with ``p > 0`` while
    training, ``torch.rand``, ``x.uniform_()``), described, or None."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _RANDOM_FUNCTIONS or \
                node.op == "call_method" and node.target in _RANDOM_METHODS:
            return f"{getattr(node.target, '__name__', node.target)} at {module_path(node) or node.name}"
        p, training = 0.0, False
        if node.op == "call_function" and node.target in _DROPOUTS:
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            p, training = bound.arguments["p"], bound.arguments["training"]
        elif node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            p, training = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0), True
        if training and p:
            return f"dropout p={_number(p)} at {module_path(node) or node.name}"
    return None


def _number(value):
    """A float argument as a number; one that ``dynamic=True`` made symbolic, at the call compiled."""
    example = value.meta.get("example_value") if isinstance(value, fx.Node) else value
    return float(example.node.hint) if isinstance(example, torch.SymFloat) else example
