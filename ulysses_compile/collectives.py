"""The only place that creates communication: the functions that rewritten graphs call, and the nodes.

Each function is an ordinary differentiable torch function built from torch's functional collectives
(``_c10d_functional`` ops followed by ``wait_tensor``), so AOTAutograd traces it into the forward graph,
derives its backward, and Inductor sees (and can reorder) real collective ops. The backward of each
placement change is chosen so that every rank ends up with single-device gradients:

===================  =========================  ======================================================
function             forward                    backward
===================  =========================  ======================================================
scatter_seq          R -> S: keep my block      S -> R: all-gather (the gradient is whole everywhere)
gather_kv_heads      S -> one whole KV head     reduce-scatter (ranks sharing the head sum its gradient)
add_previous_ranks_  cumsum over the sequence   reduce-scatter of the totals' gradients
totals
gather_seq           S -> R: all-gather         R -> S: keep my block of the (replicated) gradient
reduce_partial       P -> R: all-reduce(sum)    identity (each partial term gets the full gradient)
sync_grad            identity                   all-reduce(sum): a replicated value used by sharded
                                                ops only receives its rank's share of the gradient
seq_to_heads         S(seq) -> S(heads)         the inverse all-to-all (autograd of all_to_all_single)
heads_to_seq         S(heads) -> S(seq)         the inverse all-to-all
===================  =========================  ======================================================
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .compat import c10d_functional

__all__ = [
    "COLLECTIVES",
    "add_previous_ranks_totals",
    "gather_kv_heads",
    "gather_seq",
    "heads_to_seq",
    "insert_call",
    "reduce_partial",
    "scatter_seq",
    "seq_to_heads",
    "sync_grad",
]


def _all_gather_dim0(x: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    out = c10d_functional.all_gather_into_tensor(x.contiguous(), world_size, group_name)
    return c10d_functional.wait_tensor(out)


def _all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return c10d_functional.wait_tensor(c10d_functional.all_reduce(x.contiguous(), "sum", group_name))


def _split_seq(shape, dim: int, outer: int, inner: int) -> list[int]:
    """``shape`` with dim ``dim`` written as ``[outer, seq, inner]``."""
    seq = shape[dim] // (outer * inner)
    return [*shape[:dim], outer, seq, inner, *shape[dim + 1 :]]


def take_block(x: torch.Tensor, dim, outer, inner, rank, world_size) -> torch.Tensor:
    """This rank's sequence block of a whole tensor (no communication)."""
    split = x.reshape(_split_seq(x.shape, dim, outer, inner))
    block = split.shape[dim + 1] // world_size
    local = split.narrow(dim + 1, rank * block, block)
    shape = list(x.shape)
    shape[dim] = outer * block * inner
    return local.reshape(shape)


def _gather_blocks(x: torch.Tensor, dim, outer, inner, world_size, group_name) -> torch.Tensor:
    split = x.reshape(_split_seq(x.shape, dim, outer, inner))  # [..., outer, S/P, inner, ...]
    seq_axis = dim + 1
    gathered = _all_gather_dim0(split.movedim(seq_axis, 0), world_size, group_name)
    # gathered: [P * S/P, ...rest] with the ranks' blocks in rank order along dim 0
    full = gathered.movedim(0, seq_axis)
    shape = list(x.shape)
    shape[dim] = x.shape[dim] * world_size
    return full.reshape(shape).contiguous()


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, outer, inner, rank, world_size, group_name):
        ctx.args = (dim, outer, inner, world_size, group_name)
        return take_block(x, dim, outer, inner, rank, world_size).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return (_gather_blocks(grad, *ctx.args), None, None, None, None, None, None)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, outer, inner, rank, world_size, group_name):
        ctx.args = (dim, outer, inner, rank, world_size)
        return _gather_blocks(x, dim, outer, inner, world_size, group_name)

    @staticmethod
    def backward(ctx, grad):
        return (take_block(grad, *ctx.args).contiguous(), None, None, None, None, None, None)


class _ReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        return _all_reduce_sum(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SyncGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad, ctx.group_name), None


def scatter_seq(x, dim: int, outer: int, inner: int, rank: int, world_size: int, group_name: str):
    """Replicate -> this rank's sequence block (``Shard`` or ``MergedShard``)."""
    return _ScatterSeq.apply(x, dim, outer, inner, rank, world_size, group_name)


def gather_seq(x, dim: int, outer: int, inner: int, rank: int, world_size: int, group_name: str):
    """This rank's sequence block -> the whole tensor on every rank."""
    return _GatherSeq.apply(x, dim, outer, inner, rank, world_size, group_name)


def reduce_partial(x, group_name: str):
    """Partial sums -> their total on every rank."""
    return _ReducePartial.apply(x, group_name)


def sync_grad(x, group_name: str):
    """Identity whose backward sums the ranks' gradients of a replicated value."""
    return _SyncGrad.apply(x, group_name)


def _all_to_all_dim0(x: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    # all_to_all_single has autograd registered by torch: its backward is the inverse all-to-all.
    split = [x.shape[0] // world_size] * world_size
    out = c10d_functional.all_to_all_single(x.contiguous(), split, split, group_name)
    return c10d_functional.wait_tensor(out)


def seq_to_heads(x, seq_dim: int, head_dim: int, world_size: int, group_name: str):
    """``[.., H, .., S/P, ..]`` -> ``[.., H/P, .., S, ..]``: the whole sequence for this rank's heads."""
    heads = x.shape[head_dim]
    split = [*x.shape[:head_dim], world_size, heads // world_size, *x.shape[head_dim + 1 :]]
    chunks = x.reshape(split).movedim(head_dim, 0)  # [P, .., H/P, .., S/P, ..]; chunk i goes to rank i
    received = _all_to_all_dim0(chunks, world_size, group_name)  # [P, ...]: chunk j holds rank j's sequence block
    joined = received.movedim(0, seq_dim)  # the source rank becomes the outer factor of the sequence
    shape = list(joined.shape)
    shape[seq_dim : seq_dim + 2] = [shape[seq_dim] * shape[seq_dim + 1]]
    return joined.reshape(shape)


def heads_to_seq(x, seq_dim: int, head_dim: int, world_size: int, group_name: str):
    """The inverse of :func:`seq_to_heads`: the same all-to-all with the two dims' roles swapped."""
    return seq_to_heads(x, head_dim, seq_dim, world_size, group_name)


def gather_kv_heads(x, seq_dim: int, head_dim: int, rank: int, world_size: int, group_name: str):
    """``[.., Hkv, .., S/P, ..]`` with P a multiple of Hkv -> the whole sequence of the one KV head that
    this rank's query heads use (``[.., 1, .., S, ..]``). Ranks sharing a KV head each hold part of its
    gradient, so the backward is torch's all-gather backward: a reduce-scatter that sums them."""
    heads = x.shape[head_dim]
    gathered = _all_gather_dim0(x.movedim(seq_dim, 0), world_size, group_name).movedim(0, seq_dim)
    return gathered.narrow(head_dim, rank // (world_size // heads), 1)


def add_previous_ranks_totals(local_cumsum, dim: int, rank: int, world_size: int, group_name: str):
    """A cumulative sum along the sharded sequence: this rank's local cumsum plus the totals of the
    ranks before it (their blocks come first). Gradients reach those ranks through the all-gather's
    reduce-scatter backward."""
    totals = local_cumsum.narrow(dim, local_cumsum.shape[dim] - 1, 1)
    gathered = _all_gather_dim0(totals.unsqueeze(0), world_size, group_name)
    return local_cumsum + gathered[:rank].sum(0)


COLLECTIVES = (gather_seq, reduce_partial, sync_grad, seq_to_heads, heads_to_seq, gather_kv_heads,
               add_previous_ranks_totals)


def insert_call(graph: fx.Graph, fn, args: tuple, *, before: fx.Node | None = None, after=None) -> fx.Node:
    """Create a call of one of this module's functions at a point; never among the placeholders."""
    if after is not None and after.op == "placeholder":
        after = [n for n in graph.nodes if n.op == "placeholder"][-1]
    anchor = graph.inserting_before(before) if before is not None else graph.inserting_after(after)
    with anchor:
        node = graph.call_function(fn, args)
    node.meta["ulysses_inserted"] = fn.__name__
    return node
