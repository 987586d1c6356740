"""Make every input arrive in the placement its consumer asked for, and outputs in the user's.

Before (placements from propagate_sharding, local computations from localize_ops)::

    emb = F.embedding(input_ids, wte)        # wants input_ids S(1), has R
    logits = linear(h, w_out)                # h S(1), w_out R and requires grad
    loss = loss_sum / count                  # wants both R, has P (partial sums)
    return (loss, logits)                    # logits S(1)

After::

    input_ids_s = scatter_seq(input_ids, 1, 1, 1, rank, P, group)      # a free local slice
    emb = F.embedding(input_ids_s, wte_synced)                      # wte_synced = sync_grad(wte, group)
    logits = linear(h, sync_grad(w_out, group))
    loss = reduce_partial(loss_sum, group) / reduce_partial(count, group)
    return (loss, gather_seq(logits, 1, 1, 1, S, rank, P, group))

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

import torch
import torch.fx as fx

from ulysses_compile.collectives import (
    add_previous_ranks_totals,
    gather_seq,
    insert_call,
    reduce_partial,
    scatter_seq,
    seq_to_heads,
    sync_grad,
)
from ulysses_compile.errors import InternalError
from ulysses_compile.sharding import (
    REPLICATE,
    NodeSharding,
    Partial,
    PartialScan,
    Replicate,
    Shard,
    completed,
    is_rank_local,
    is_sharded,
    place,
    seq_factors,
    sharding_of,
)


log = logging.getLogger("ulysses_compile")


class _Redistributor:
    def __init__(self, graph: fx.Graph, ctx):
        self.graph = graph
        self.ctx = ctx
        self.converted: dict[tuple[fx.Node, object], fx.Node] = {}
        self.synced: dict[fx.Node, fx.Node] = {}

    def to(self, node: fx.Node, have, want) -> fx.Node:
        if have == want:
            return node
        key = (node, want)
        if key not in self.converted:
            self.converted[key] = self._convert(node, have, want)
        return self.converted[key]

    def _convert(self, node, have, want) -> fx.Node:
        ctx = self.ctx
        done = completed(have)
        if done != have:
            # One completion of a pending sum, shared by every consumer (and by an in-place write into it).
            if want != done:
                return self.to(self.to(node, have, done), done, want)
            if isinstance(have, Partial):
                return self._insert(reduce_partial, (node, ctx.group_name), node, done)
            return self._insert(add_previous_ranks_totals, (node, have.dim, ctx.rank, ctx.world_size,
                                                            ctx.group_name), node, done)
        if have == want or _same_blocks(have, want):
            return node
        if self._all_to_all_ok(node, have, want):
            # Shard(a) -> Shard(b): one all-to-all, as before an attention (sequence -> heads) and after it.
            length = sharding_of(node).global_value.shape[have.dim]
            return self._insert(seq_to_heads, (node, have.dim, want.dim, length, ctx.rank, ctx.world_size,
                                               ctx.group_name), node, want)
        if seq_factors(have) is not None:
            dim, outer, inner = seq_factors(have)
            length = sharding_of(node).global_value.shape[dim] // (outer * inner)
            node = self._insert(gather_seq, (node, dim, outer, inner, length, ctx.rank, ctx.world_size,
                                             ctx.group_name), node, REPLICATE)
            have = REPLICATE
        if have == want:
            return node
        if isinstance(want, (Partial, PartialScan)):
            raise InternalError(f"a rule asked for {node.name} as a partial sum, which no conversion produces")
        return self._insert(scatter_seq, (node, *seq_factors(want), ctx.rank, ctx.world_size, ctx.group_name),
                            node, want)

    def _all_to_all_ok(self, node, have, want) -> bool:
        value = sharding_of(node).global_value
        return (
            isinstance(have, Shard)
            and isinstance(want, Shard)
            and isinstance(value, torch.Tensor)
            and value.shape[want.dim] >= self.ctx.world_size
        )

    def _insert(self, fn, args, after: fx.Node, placement) -> fx.Node:
        source = sharding_of(args[0]) if isinstance(args[0], fx.Node) else None
        return place(insert_call(self.graph, fn, args, after=after),
                     NodeSharding(placement, source.global_value if source else None))

    def synced_for_local_use(self, node: fx.Node) -> fx.Node:
        if node not in self.synced:
            self.synced[node] = self._insert(sync_grad, (node, self.ctx.group_name), node, REPLICATE)
        return self.synced[node]


def _same_blocks(have, want) -> bool:
    """``MergedShard(d, 1, inner)`` and ``Shard(d)`` both hold one contiguous block of dim d per rank."""
    have_factors, want_factors = seq_factors(have), seq_factors(want)
    return (
        have_factors is not None
        and want_factors is not None
        and have_factors[0] == want_factors[0]
        and have_factors[1] == want_factors[1] == 1
    )


def _requires_grad(node: fx.Node) -> bool:
    sharding = sharding_of(node)
    value = sharding.global_value if sharding is not None else node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.requires_grad


def redistribute(gm: fx.GraphModule, ctx) -> list[str]:
    """Insert the conversions; returns a line for each output gathered from sequence shards."""
    graph = gm.graph
    redistributor = _Redistributor(graph, ctx)
    gathered: list[str] = []
    for node in list(graph.nodes):
        sharding = sharding_of(node)
        if node.op == "output":
            gathered = _redistribute_outputs(node, redistributor, ctx)
            continue
        if sharding is None:
            continue
        local_op = is_rank_local(sharding.output)
        for arg in dict.fromkeys(node.all_input_nodes):
            have = sharding_of(arg).output if sharding_of(arg) else None
            if have is None or isinstance(have, tuple):
                continue
            want = sharding.inputs.get(arg, REPLICATE)
            new = redistributor.to(arg, have, want)
            if local_op and isinstance(want, Replicate) and _requires_grad(new):
                new = redistributor.synced_for_local_use(new)
            if new is not arg:
                node.replace_input_with(arg, new)
    return gathered


def _redistribute_outputs(output: fx.Node, redistributor: _Redistributor, ctx) -> list[str]:
    gathered = []

    def convert(arg):
        sharding = sharding_of(arg)
        if sharding is None or sharding.output is None or isinstance(sharding.output, tuple):
            return arg
        have = sharding.output
        if ctx.options.outputs == "local":
            return redistributor.to(arg, have, completed(have))
        if is_sharded(completed(have)):
            shape = list(sharding.global_value.shape)
            gathered.append(
                f"{arg.name} {shape} leaves the graph sequence-sharded and is gathered (the model's output, or a "
                f"value crossing a graph break, which the next graph slices again)"
            )
            log.info("ulysses_compile: %s", gathered[-1])
        return redistributor.to(arg, have, REPLICATE)

    output.args = fx.node.map_arg(output.args, convert)
    return gathered
