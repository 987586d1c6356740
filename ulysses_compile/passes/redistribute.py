"""Make every input arrive in the placement its consumer asked for, and outputs in the user's.

Before (placements from propagate_sharding, local computations from localize_ops)::

    emb = F.embedding(input_ids, wte)        # wants input_ids S(1), has R
    logits = linear(h, w_out)                # h S(1), w_out R and requires grad
    loss = loss_sum / count                  # wants both R, has P (partial sums)
    return (loss, logits)                    # logits S(1)

After::

    input_ids_s = scatter_seq(input_ids, 1, 1, 1, rank, P, group)      # the rank's block, no communication
    emb = F.embedding(input_ids_s, wte_synced)                      # wte_synced = sync_grad(wte, group)
    logits = linear(h, sync_grad(w_out, group))
    loss = reduce_partial(loss_sum, group) / reduce_partial(count, group)
    return (loss, gather_seq(logits, 1, 1, 1, S, rank, P, group))

By default (``outputs="lazy"``) an output stays sharded (``return (loss, logits)``), whether it goes
to the caller or across a graph break to the next graph: the caller gets a tensor gathered when read,
the next graph the rank's block (``boundary.py``). With ``outputs="dtensor"`` only an output that goes
straight to the caller stays sharded, as a DTensor.

A replicated value that requires grad and is used by a rank-local op goes through ``sync_grad`` once,
shared by all such uses, so its gradient is summed over ranks inside the backward graph. This is
where every collective that changes a placement is created (the all-to-alls around attention, whose
layout only the site knows, are insert_all_to_all's; data-parallel averaging and ZeRO's gathers
theirs).

Pinned on a small model: ``tests/test_pass_goldens.py::test_redistribute`` and
``test_redistribute_reduces_partial_sums``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ulysses_compile.core.boundary import SequenceBlocks, even_blocks
from ulysses_compile.core.collectives import (
    add_previous_ranks_totals,
    gather_seq,
    insert_call,
    reblock_seq,
    reduce_partial,
    scatter_seq,
    seq_to_heads,
    sync_grad,
)
from ulysses_compile.core.errors import InternalError
from ulysses_compile.core.fx_graph import mutated_arg
from ulysses_compile.core.sharding import (
    REPLICATE,
    NodeSharding,
    Partial,
    PartialScan,
    MergedShard,
    Replicate,
    Shard,
    block_sizes,
    completed,
    is_permuted,
    is_rank_local,
    is_sharded,
    place,
    seq_factors,
    sharding_of,
)
from ulysses_compile.core.sizes import is_symbolic
from ulysses_compile.passes.in_place_writes import alias_bases, may_alias, written_bases


log = logging.getLogger("ulysses_compile")


class _Redistributor:
    def __init__(self, graph: fx.Graph, ctx):
        self.graph = graph
        self.ctx = ctx
        self.converted: dict[tuple, fx.Node] = {}
        self.synced: dict[tuple, fx.Node] = {}
        # A value written in place through its conversion (a completed partial sum): later readers start
        # from that conversion, which holds the write.
        self.holder: dict[fx.Node, tuple[fx.Node, object]] = {}

    def to(self, node: fx.Node, have, want, before: fx.Node | None = None, version: int = 0) -> fx.Node:
        """``node`` converted from ``have`` to ``want``: placed right after it, or just before
        ``before`` (a consumer, when ``node`` is written in place somewhere); shared by the consumers
        that read the same ``version`` of it (the number of in-place writes into it before them)."""
        source, source_have = self.holder.get(node, (node, have))
        if source_have == want:
            return source
        key = (node, want, version)
        if key not in self.converted:
            self.converted[key] = self._convert(source, source_have, want, before, version)
        return self.converted[key]

    def written_through(self, node: fx.Node, conversion: fx.Node, placement) -> None:
        self.holder[node] = (conversion, placement)

    def _convert(self, node, have, want, before, version) -> fx.Node:
        ctx = self.ctx
        done = completed(have)
        if done != have:
            # One completion of a pending sum, shared by every consumer that reads the same version.
            if want != done:
                return self.to(self.to(node, have, done, before, version), done, want, before, version)
            if isinstance(have, Partial):
                return self._insert(reduce_partial, (node, ctx.group_name), node, done, before)
            return self._insert(add_previous_ranks_totals, (node, have.dim, ctx.rank_for(node.graph), ctx.world_size,
                                                            ctx.group_name), node, done, before)
        if have == want:
            return node
        blocks = _row_blocks(have, want, sharding_of(node).global_value, ctx.world_size)
        if blocks is not None and blocks[0] == blocks[1]:
            return node
        if blocks is not None and ctx.head_tail:
            raise InternalError(f"{node.name} would move rows between blocks of different sizes ({have} to {want}) "
                                f"in the head-tail layout, which plan_sequence_layout chooses only for lengths that "
                                f"cut evenly")
        if blocks is not None:
            held, wanted = blocks
            return self._insert(reblock_seq, (node, have.dim, held, wanted, ctx.rank, ctx.world_size, ctx.group_name),
                                node, want, before)
        if is_permuted(have) or is_permuted(want):
            raise InternalError(f"{node.name} is {have} and was asked for as {want}: rows in a rank's own order "
                                f"have no conversion (propagate_sharding gathers their sort's input instead)")
        if not ctx.head_tail and _between_dims(sharding_of(node).global_value, have, want, ctx.world_size):
            # Shard(a) -> Shard(b): one all-to-all, as before an attention (sequence -> heads) and after it;
            # from a dim that holds the split dim with another merged after it ([B, S, H*D] over H), the same.
            dim, _, inner = seq_factors(have)
            length = sharding_of(node).global_value.shape[dim] // inner
            rank = ctx.rank_for(node.graph, length, sharding_of(node).global_value.shape[want.dim])
            if inner == 1:
                return self._insert(seq_to_heads, (node, dim, want.dim, length, rank, ctx.world_size, ctx.group_name),
                                    node, want, before)
            return self._all_to_all_apart(node, dim, (-1, inner), dim, want.dim + (want.dim > dim), length, rank,
                                          before, want)
        regrouped = None if ctx.head_tail else regrouping(sharding_of(node).global_value, have, want, ctx.world_size)
        if regrouped is not None:
            # One dim holding [outer, S, H, inner], split over H, to the same split over S: one all-to-all.
            dim, outer, sequence, heads, inner = regrouped
            return self._all_to_all_apart(node, dim, (outer, sequence, -1, inner), dim + 2, dim + 1, heads,
                                          ctx.rank_for(node.graph, heads, sequence), before, want)
        if seq_factors(have) is not None:
            dim, outer, inner = seq_factors(have)
            length = sharding_of(node).global_value.shape[dim] // (outer * inner)
            node = self._insert(gather_seq, (node, dim, outer, inner, length, ctx.rank_for(node.graph, length), ctx.world_size,
                                             ctx.group_name, *ctx.layout_args()), node, REPLICATE, before)
            have = REPLICATE
        if have == want:
            return node
        if isinstance(want, (Partial, PartialScan)):
            raise InternalError(f"a rule asked for {node.name} as a partial sum, which no conversion produces")
        dim, outer, inner = seq_factors(want)
        rank = ctx.rank_for(node.graph, sharding_of(node).global_value.shape[dim] // (outer * inner))
        return self._insert(scatter_seq, (node, dim, outer, inner, rank, ctx.world_size, ctx.group_name,
                                          *ctx.layout_args()), node, want, before)

    def _all_to_all_apart(self, node: fx.Node, dim: int, sizes: tuple, held: int, wanted: int, length: int, rank,
                          before: fx.Node | None, want) -> fx.Node:
        """``node`` with dim ``dim`` viewed as ``sizes`` (the rank's block as -1), one all-to-all from the
        split dim ``held`` (of ``length``) to ``wanted`` (dims of that view), and the dim merged back."""
        apart = self._insert_method(node, "unflatten", (dim, sizes), before)
        moved = self._insert(seq_to_heads, (apart, held, wanted, length, rank, self.ctx.world_size, self.ctx.group_name),
                             apart, None, before)
        return self._insert_method(moved, "flatten", (dim, dim + len(sizes) - 1), before, want)

    def _insert_method(self, source: fx.Node, method: str, args: tuple, before: fx.Node | None,
                       placement=None) -> fx.Node:
        anchor = self.graph.inserting_before(before) if before is not None else self.graph.inserting_after(source)
        with anchor:
            call = self.graph.call_method(method, (source, *args))
        return place(call, NodeSharding(placement, sharding_of(source).global_value))

    def _insert(self, fn, args, after: fx.Node, placement, before: fx.Node | None) -> fx.Node:
        source = sharding_of(args[0]) if isinstance(args[0], fx.Node) else None
        call = insert_call(self.graph, fn, args, before=before) if before is not None \
            else insert_call(self.graph, fn, args, after=after)
        return place(call, NodeSharding(placement, source.global_value if source else None))

    def synced_for_local_use(self, node: fx.Node, before: fx.Node | None, version: int) -> fx.Node:
        if (node, version) not in self.synced:
            self.synced[(node, version)] = self._insert(sync_grad, (node, self.ctx.group_name), node, REPLICATE,
                                                        before)
        return self.synced[(node, version)]


class _Writes:
    """In-place writes in graph order. A conversion must read the value its consumer reads: for a
    value written in place after it is made (through any alias), that is the value just before the
    consumer, not the one right after the producer."""

    def __init__(self, graph: fx.Graph):
        self.base = alias_bases(graph)
        self.version = dict.fromkeys(written_bases(graph, self.base), 0)

    def anchor(self, node: fx.Node, consumer: fx.Node) -> fx.Node | None:
        return consumer if self.base.get(node, node) in self.version else None

    def seen(self, node: fx.Node) -> int:
        return self.version.get(self.base.get(node, node), 0)

    def record(self, written: fx.Node | None) -> None:
        if isinstance(written, fx.Node):
            self.version[self.base.get(written, written)] += 1


def all_to_all_converts(value, have, want, world_size: int) -> bool:
    """Whether one all-to-all converts ``have`` to ``want`` (the sequence in contiguous blocks: in the
    head-tail layout it would give the whole sequence in that layout's order): between two sharded dims,
    the held one possibly merged with dims after it, or one dim merging a sequence and heads
    (``regrouping``)."""
    return _between_dims(value, have, want, world_size) or regrouping(value, have, want, world_size) is not None


def _between_dims(value, have, want, world_size: int) -> bool:
    return (isinstance(value, torch.Tensor) and isinstance(want, Shard)
            and (isinstance(have, Shard) or isinstance(have, MergedShard) and have.outer == 1
                 and not is_symbolic(have.inner) and have.dim != want.dim)
            and value.shape[want.dim] >= world_size)


def regrouping(value, have, want, world_size: int) -> tuple | None:
    """(dim, outer, S, H, inner) where ``have`` and ``want`` split one dim holding [outer, S, H, inner]
    over H and over S (``MergedShard(d, outer * S, inner)`` to ``MergedShard(d, outer, H * inner)``: the
    gated norm's ``[B*S*H, D]`` rows after a scan on the heads), all static, each at least P; else None."""
    have_factors, want_factors = seq_factors(have), seq_factors(want)
    if not isinstance(value, torch.Tensor) or have_factors is None or want_factors is None \
            or have_factors[0] != want_factors[0]:
        return None
    dim, have_outer, have_inner = have_factors
    _, outer, want_inner = want_factors
    size = value.shape[dim]
    if any(is_symbolic(n) for n in (size, have_outer, have_inner, outer, want_inner)) or have_outer % outer \
            or want_inner % have_inner:
        return None
    sequence, heads = have_outer // outer, want_inner // have_inner
    if min(sequence, heads) < world_size or outer * sequence * heads * have_inner != size:
        return None
    return dim, outer, sequence, heads, have_inner


def _row_blocks(have, want, value, world_size: int) -> tuple[tuple, tuple] | None:
    """The rows of dim d each rank holds and would hold, ``(first, count)`` per rank, where ``have`` and
    ``want`` each hold one contiguous block of it per rank (``MergedShard(d, 1, inner)``, ``Shard(d)``):
    the balanced blocks of the merged sequence, ``inner`` rows a position. They differ where P does not
    divide the sequence: BLT's 25 patches of 2 rows each at P = 4 are rows 14, 12, 12, 12, the dim's 50
    rows blocks of 13, 13, 12, 12. None otherwise, and for a symbolic length whose blocks may differ."""
    have_factors, want_factors = seq_factors(have), seq_factors(want)
    if have_factors is None or want_factors is None or have_factors[0] != want_factors[0] \
            or not have_factors[1] == want_factors[1] == 1:
        return None
    rows = value.shape[have_factors[0]]
    if is_symbolic(rows):
        same = have_factors[2] == want_factors[2] or (even_blocks(rows // have_factors[2], world_size)
                                                      and even_blocks(rows // want_factors[2], world_size))
        return ((), ()) if same else None

    def blocks(inner: int) -> tuple:
        sizes = [size * inner for size in block_sizes(rows // inner, world_size)]
        return tuple((sum(sizes[:rank]), size) for rank, size in enumerate(sizes))

    return blocks(have_factors[2]), blocks(want_factors[2])


def _requires_grad(node: fx.Node) -> bool:
    sharding = sharding_of(node)
    value = sharding.global_value if sharding is not None else node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.requires_grad


def redistribute(gm: fx.GraphModule, ctx) -> Outputs:
    """Insert the conversions; returns the outputs gathered from sequence shards (with why) and those
    that leave the graph sharded."""
    graph = gm.graph
    redistributor = _Redistributor(graph, ctx)
    writes = _Writes(graph)
    outputs = Outputs()
    for node in list(graph.nodes):
        sharding = sharding_of(node)
        if node.op == "output":
            outputs = _redistribute_outputs(node, redistributor, ctx, writes)
            continue
        written = mutated_arg(node)
        if sharding is None:
            writes.record(written)
            continue
        local_op = is_rank_local(sharding.output)
        for arg in dict.fromkeys(node.all_input_nodes):
            have = sharding_of(arg).output if sharding_of(arg) else None
            if have is None or isinstance(have, tuple):
                continue
            want = sharding.inputs.get(arg, REPLICATE)
            before, version = writes.anchor(arg, node), writes.seen(arg)
            new = redistributor.to(arg, have, want, before, version)
            if local_op and isinstance(want, Replicate) and _requires_grad(new):
                new = redistributor.synced_for_local_use(new, before, version)
            if new is not arg:
                node.replace_input_with(arg, new)
                if arg is written or (before is not None and may_alias(node) and completed(have) != have):
                    # A write into it, or into a view of its completion, lands on the conversion.
                    redistributor.written_through(arg, new, want)
        writes.record(written)
    return outputs


@dataclass
class Outputs:
    gathered: list[str] = field(default_factory=list)  # a line for each sequence-sharded output gathered
    sharded: dict[int, SequenceBlocks] = field(default_factory=dict)  # output position -> how it leaves sharded


def _redistribute_outputs(output: fx.Node, redistributor: _Redistributor, ctx, writes: _Writes) -> Outputs:
    found = Outputs()

    def convert(position: int, arg):
        sharding = sharding_of(arg) if isinstance(arg, fx.Node) else None
        if sharding is None or sharding.output is None or isinstance(sharding.output, tuple):
            return arg
        have = sharding.output
        before, version = writes.anchor(arg, output), writes.seen(arg)
        if ctx.options.outputs == "local":
            return redistributor.to(arg, have, completed(have), before, version)
        if not is_sharded(completed(have)):
            return redistributor.to(arg, have, REPLICATE, before, version)
        shape = list(sharding.global_value.shape)
        why = _why_gathered(completed(have), shape, ctx)
        if not why:
            dim, outer, inner = seq_factors(completed(have))
            length = shape[dim] // (outer * inner)
            found.sharded[position] = SequenceBlocks(dim, outer, inner, None if is_symbolic(length) else length,
                                                     ctx.head_tail)
            return redistributor.to(arg, have, completed(have), before, version)
        found.gathered.append(f"{arg.name} {shape} leaves the graph sequence-sharded and is gathered: {why}")
        log.info("ulysses_compile: %s", found.gathered[-1])
        return redistributor.to(arg, have, REPLICATE, before, version)

    values = output.args[0]  # Dynamo's graphs return a flat tuple, the compiled function's outputs in order
    flat = list(values) if isinstance(values, (tuple, list)) else [values]
    converted = [convert(position, arg) for position, arg in enumerate(flat)]
    output.args = (type(values)(converted) if isinstance(values, (tuple, list)) else converted[0],)
    return found


def _why_gathered(placement, shape: list, ctx) -> str:
    """Why a sequence-sharded output is gathered in the graph, or "" when it leaves sharded
    (``boundary.py``)."""
    crossing = f"a graph break ({ctx.graph_break})" if ctx.graph_break else \
        "code that runs before the caller reads it" if not ctx.outputs_to_caller else ""
    if crossing and ctx.options.outputs != "lazy":
        return (f"it crosses {crossing} under option outputs={ctx.options.outputs!r}, which leaves sharded only "
                f"what goes straight to the caller; the next graph slices it again")
    if ctx.options.outputs == "gather":
        return 'option outputs="gather" (the default, outputs="lazy", gathers it when read)'
    dim, outer, inner = seq_factors(placement)
    length = shape[dim] // (outer * inner)
    if is_symbolic(outer) or is_symbolic(inner):
        return f"the dims merged with the sequence have a symbolic size ({outer} x S x {inner})"
    if ctx.options.outputs == "dtensor" and not isinstance(placement, Shard):
        return "it is sharded inside merged dims (as [B*S, V] is), which no DTensor placement describes"
    if not even_blocks(length, ctx.world_size) and (ctx.options.outputs == "dtensor" or is_symbolic(length)):
        return (f"P = {ctx.world_size} does not divide its {length} positions, and " + (
            "DTensor's blocks (torch.chunk's) differ from the balanced ones here" if ctx.options.outputs == "dtensor"
            else "the graph, compiled for every length, could not tell the length from the rank's block"))
    return ""
