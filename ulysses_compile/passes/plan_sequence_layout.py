"""Choose how the ranks hold the sequence: contiguous blocks, or the head-tail layout that evens a ring's
causal work.

In contiguous blocks, ring place i of a causal attention computes i + 1/2 of its R blocks, so the last
place works 2R - 1 times as long as the first and every other waits for it. In the head-tail layout
the sequence is cut in 2R chunks and laid out in the order 0, 2R-1, 1, 2R-2, ..., R-1, R before the P
blocks are cut (``collectives.head_tail_positions``): ring place i holds chunks i and 2R - 1 - i, and
every place computes the same (``ring_attention._visible_parts``). The layout is the compiler's: the
inputs' blocks are taken in it, every gather puts the positions back in order, and the outputs the
user reads are in order.

The graph is not rewritten here; it returns the layout the later passes lay the sequence out in
(``PassContext.head_tail``). Before and after, on a Llama whose every attention runs as a causal ring
of R = 2 (P = 4, U = 2), the graph is the same; the calls the later passes insert read it::

    input_ids_s = scatter_seq(input_ids, 1, 1, 1, rank, 4, group)          # contiguous: positions 16r ... 16r + 15
    input_ids_s = scatter_seq(input_ids, 1, 1, 1, rank, 4, group, 2)       # head-tail: rank 1 holds 48 ... 63
    out = ring_attention(q, k, v, is_causal=True, group_name=ring, head_tail=True)

Head-tail is chosen where every attention site runs as a ring of the same R > 1, one of them causal
(a non-causal ring's work is even already), with the option ``layout`` at ``"auto"``, and nothing in the
graph needs contiguous blocks: a sharded sequence of a length that 2R chunks and P blocks do not cut
evenly, cross-attention, an op whose localization is written for contiguous blocks (a slice or shift
of the sequence, a position's owner: ``rules.needs_contiguous_blocks``), a cumulative sum along the
sequence, outputs handed to the caller as their rank's block (``outputs="dtensor"`` or ``"local"``).
A graph without attention that receives the blocks of a graph before it in the head-tail layout keeps
that layout where it can. Anything else is contiguous, with the reason in the report.

Pinned on a small model: ``tests/test_pass_goldens.py::test_plan_sequence_layout``; its cases in
``tests/test_ring.py::test_sequence_layout_plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ulysses_compile.core.report import module_path
from ulysses_compile.core.sharding import PartialScan, seq_factors, sharding_of
from ulysses_compile.core.sizes import is_symbolic
from ulysses_compile.passes.rules import needs_contiguous_blocks


@dataclass(frozen=True)
class SequenceLayout:
    head_tail: int  # the ring's size R where the layout is head-tail, 0 for contiguous blocks
    why: str  # what was chosen and why ("" for a graph with no ring and nothing to say)


def plan_sequence_layout(gm: fx.GraphModule, ctx, sites: list) -> SequenceLayout:
    rings = {site.ring for site in sites}
    if sites:
        if rings == {1}:
            return SequenceLayout(0, "")
        if len(rings) > 1:
            return _contiguous(f"the attention sites run rings of different sizes ({sorted(rings)})")
        (ring,) = rings
        candidate = f"every attention runs as a causal ring of {ring}"
        if not any(site.is_causal for site in sites):
            return SequenceLayout(0, "contiguous blocks: no attention runs is_causal (a mask given as a tensor "
                                     "computes every block of the ring in either layout)")
    elif len(ctx.lazy_head_tail) == 1 and 0 not in ctx.lazy_head_tail:
        (ring,) = ctx.lazy_head_tail
        candidate = "it receives the blocks of the graph before it in that layout"
    else:
        return SequenceLayout(0, "")
    blocker = _blocker(gm, ctx, sites, ring)
    if blocker:
        return _contiguous(blocker)
    return SequenceLayout(ring, f"head-tail over a ring of {ring} (ring place i holds chunks i and {2 * ring - 1} - i "
                                f"of {2 * ring}): {candidate}")


def _contiguous(why: str) -> SequenceLayout:
    return SequenceLayout(0, f"contiguous blocks, so a causal ring's work is uneven: {why}")


def _blocker(gm: fx.GraphModule, ctx, sites: list, ring: int) -> str:
    """What in the graph needs contiguous blocks, or ""."""
    if ctx.options.layout == "contiguous":
        return "option layout='contiguous'"
    if ctx.options.outputs in ("dtensor", "local"):
        return f"option outputs={ctx.options.outputs!r} hands the caller each rank's block, in contiguous blocks"
    for site in sites:
        if site.seq_len != site.kv_seq_len:
            return f"{site.module or site.node.name} attends over another sequence (cross-attention)"
    unit = math.lcm(2 * ring, ctx.world_size)
    for node in gm.graph.nodes:
        sharding = sharding_of(node)
        if sharding is None:
            continue
        where = module_path(node) or node.name
        what = needs_contiguous_blocks(sharding.localize)
        if what:
            return f"{where} is {what}"
        placements = sharding.output if isinstance(sharding.output, tuple) else (sharding.output,)
        values = sharding.global_value if isinstance(sharding.global_value, (tuple, list)) else (sharding.global_value,)
        for placement, value in zip(placements, values):
            if isinstance(placement, PartialScan):
                return f"{where} is a cumulative sum along the sequence"
            factors = seq_factors(placement) if placement is not None else None
            if factors is None or not isinstance(value, torch.Tensor):
                continue
            dim, outer, inner = factors
            length = value.shape[dim] // (outer * inner)
            if is_symbolic(length) or length % unit:
                return (f"{where} holds a sequence of {length} positions, which does not cut into {2 * ring} "
                        f"chunks and {ctx.world_size} blocks of one size (a multiple of {unit} does)")
    return ""
