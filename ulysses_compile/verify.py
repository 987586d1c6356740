"""Checks against eager execution: ``options={"verify": True}`` (a compiled graph's first call) and the
comparison table that it and ``python -m ulysses_compile verify`` print."""

from __future__ import annotations

import torch
import torch.fx as fx

from .collectives import take_block
from .errors import VerificationError
from .sharding import seq_factors, sharding_of

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
        error = (got64 - want64).abs().max().item() if got.numel() else 0.0
        scale = want64.abs().max().item() if want.numel() else 0.0
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
