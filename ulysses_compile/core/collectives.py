"""The only place that creates communication: the functions that rewritten graphs call, and the nodes.

Each function is an ordinary differentiable torch function built from torch's functional collectives
(``_c10d_functional`` ops followed by ``wait_tensor``), so AOTAutograd traces it into the forward graph,
derives its backward, and Inductor sees (and can reorder) real collective ops. Blocks follow
``sharding.block_sizes``: balanced, uneven when P does not divide the dim; in the head-tail layout
(``head_tail``: the ring's size R) a rank's block holds two chunks of 2R (``head_tail_positions``).
``rank`` is an int, or the 0-dim tensor ``rank_of_group`` reads when the graph runs (blocks of one
size only); ``mesh_group_name`` gives a mesh dim's groups one name on every rank. The backward of each
placement change is chosen so that every rank ends up with single-device gradients:

===================  =========================  ======================================================
function             forward                    backward
===================  =========================  ======================================================
scatter_seq          R -> S: keep my block      S -> R: all-gather (the gradient is whole everywhere)
gather_kv_heads      S -> whole KV heads        reduce-scatter (ranks sharing a head sum its gradient)
add_previous_ranks_  cumsum over the sequence   reduce-scatter of the totals' gradients
totals
gather_seq           S -> R: all-gather         R -> S: keep my block of the (replicated) gradient
reduce_partial       P -> R: all-reduce(sum)    identity (each partial term gets the full gradient)
sync_grad            identity                   all-reduce(sum): a replicated value used by sharded
                                                ops only receives its rank's share of the gradient
average_grad         identity                   all-reduce(sum) / D over the data-parallel replicas
gather_parameter     ZeRO shard -> parameter:   reduce-scatter(sum) / N into the shards (N: every
                     all-gather                 rank holding a shard, data x sequence), or / D of
                                                the sequence ranks' shares (sync_grad merged in)
seq_to_heads         S(seq) -> S(heads)         the inverse all-to-all (autograd of all_to_all_single)
seq_to_heads_qkv     the same for q, k and v    one inverse all-to-all
                     in one all-to-all
heads_to_seq         S(heads) -> S(seq)         the inverse all-to-all
reblock_seq          S -> S of a slice of the   the inverse all-to-all (each row's gradient back to
                     sequence, in its own       the rank that sent it)
                     blocks: rows between
                     neighbours
shift_seq            S -> S shifted by k rows:  reduce-scatter (each row's gradient back to the rank
                     the k rows leaving each    that sent it)
                     block all-gathered
rows_before          S -> the k rows before     reduce-scatter, as shift_seq's
                     the block (a causal
                     convolution's reach)
===================  =========================  ======================================================
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import os

import torch
import torch.fx as fx

from ulysses_compile.core.compat import (
    _register_process_group,
    _resolve_process_group,
    _unregister_process_group,
    c10d_functional,
    new_group_named,
)
from ulysses_compile.core.errors import InternalError
from ulysses_compile.core.sharding import block_range, block_sizes
from ulysses_compile.core.sizes import is_symbolic, size_arg

__all__ = [
    "COLLECTIVES",
    "add_previous_ranks_totals",
    "average_grad",
    "gather_blocks",
    "gather_kv_heads",
    "gather_objects",
    "gather_parameter",
    "gather_rows",
    "gather_seq",
    "heads_to_seq",
    "insert_call",
    "reblock_seq",
    "reduce_partial",
    "rows_before",
    "scatter_seq",
    "seq_to_heads",
    "seq_to_heads_qkv",
    "shift_seq",
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


def _merge_seq(split: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(split.shape)
    shape[dim : dim + 3] = [shape[dim] * shape[dim + 1] * shape[dim + 2]]
    return split.reshape(shape)


def take_block(x: torch.Tensor, dim, outer, inner, rank, world_size, head_tail: int = 0) -> torch.Tensor:
    """This rank's sequence block of a whole tensor (no communication); a copy where ``rank`` is read
    at run time (``rank_of_group``), as its start is then a tensor, or where the layout is head-tail
    (``head_tail``: the ring's size, 0 for contiguous blocks)."""
    split = x.reshape(_split_seq(x.shape, dim, outer, inner))
    if head_tail:
        positions = head_tail_positions(split.shape[dim + 1], world_size, head_tail, rank, x.device)
        return _merge_seq(split.index_select(dim + 1, positions), dim)
    return _merge_seq(narrow_at(split, dim + 1, *block_range(split.shape[dim + 1], world_size, rank)), dim)


def head_tail_positions(length: int, world_size: int, ring: int, rank, device) -> torch.Tensor:
    """The positions of a sequence of ``length`` that rank ``rank`` holds in the head-tail layout of a ring
    of ``ring``: the sequence cut in 2R chunks, laid out in the order 0, 2R-1, 1, 2R-2, ..., R-1, R and
    that order cut in P blocks, so the ranks of ring place i hold chunks i and 2R-1-i and the causal work
    of every place is the same. ``length`` is a multiple of 2R and of P."""
    block, chunk = length // world_size, length // (2 * ring)
    laid_out = torch.arange(block, device=device) + rank * block
    slot, offset = laid_out // chunk, laid_out % chunk
    return torch.where(slot % 2 == 0, slot // 2, 2 * ring - 1 - slot // 2) * chunk + offset


def head_tail_order(length: int, ring: int, device) -> torch.Tensor:
    """For each position of the sequence, its place in the head-tail layout (the ranks' blocks one after
    the other): the inverse of :func:`head_tail_positions` over all ranks."""
    chunk = length // (2 * ring)
    position = torch.arange(length, device=device)
    natural, offset = position // chunk, position % chunk
    return torch.where(natural < ring, 2 * natural, 2 * (2 * ring - 1 - natural) + 1) * chunk + offset


def narrow_at(x: torch.Tensor, dim: int, start, size: int) -> torch.Tensor:
    """``x.narrow(dim, start, size)`` for an int ``start``; a copy for a 0-dim tensor computed at run time."""
    if isinstance(start, torch.Tensor):
        return x.index_select(dim, torch.arange(size, device=x.device) + start)
    return x.narrow(dim, start, size)


def rank_of_group(group_name: str, device: torch.device) -> torch.Tensor:
    """This process's rank in the group, read when the graph runs (a 0-dim int64 tensor on ``device``,
    the graph's, filled there: no copy between devices), so that the graphs of the group's ranks, and
    their compiled code, are one."""
    return _group_rank_op()(group_name, device)


@functools.cache
def _group_rank_op():
    """An op AOTAutograd and Inductor call rather than trace: the rank is not known when tracing."""

    @torch.library.custom_op("ulysses_compile::group_rank", mutates_args=())
    def group_rank(group_name: str, device: torch.device) -> torch.Tensor:
        return torch.full((), _resolve_process_group(group_name).rank(), dtype=torch.int64, device=device)

    @group_rank.register_fake
    def _(group_name, device):
        return torch.empty((), dtype=torch.int64, device=device)

    return group_rank


def mesh_group_name(mesh, dim: str, root=None) -> str:
    """A name under which every rank finds its own group along the mesh dim ``dim``, the same on every
    rank (torch names each group of a mesh dim apart, so the ranks' collectives, and code, would differ).
    The name comes from the layout of ``root`` (default ``mesh``; for a mesh flattened from dims of a
    larger one, the larger one, whose layout every rank sees whole). A later mesh of the same layout takes
    the name over: its group along ``dim`` holds the same ranks, so the graphs compiled before it meet
    alike."""
    group = mesh.get_group(dim)
    root = mesh if root is None else root
    layout = f"{root.device_type} {root.mesh_dim_names} {root.mesh.tolist()}"
    name = f"ulysses_{dim}_{hashlib.sha1(layout.encode()).hexdigest()[:12]}"
    try:
        if _resolve_process_group(name).group_name == group.group_name:
            return name
        _unregister_process_group(name)
    except (RuntimeError, ValueError):  # not registered in this process yet (nor since the groups were destroyed)
        pass
    _register_process_group(name, group)
    return name


def rank_node(graph: fx.Graph, group_name: str) -> fx.Node:
    """The graph's one ``rank = rank_of_group(group_name, device)``, after its placeholders, on the
    device of its first tensor input."""
    for node in graph.find_nodes(op="call_function", target=rank_of_group):
        if node.args[0] == group_name:
            return node
    placeholders = list(graph.find_nodes(op="placeholder"))
    values = (node.meta.get("example_value", node.meta.get("val")) for node in placeholders)
    device = next((value.device for value in values if isinstance(value, torch.Tensor)), torch.device("cpu"))
    with graph.inserting_after(placeholders[-1]):
        return graph.call_function(rank_of_group, (group_name, device), name="rank")


def block_positions(block: torch.Tensor, shape, dim, outer, inner, rank, world_size, head_tail: int = 0) -> torch.Tensor:
    """The flat position, in a contiguous whole tensor of ``shape``, of every element of this rank's
    sequence block ``block`` (int64, ``block``'s shape; ``head_tail``: the block of that layout): computed
    from aranges of the block's sizes, so nothing of the whole tensor's size is made."""
    split = _split_seq(block.shape, dim, outer, inner)
    whole = _split_seq(shape, dim, outer, inner)
    positions = torch.zeros((), dtype=torch.int64, device=block.device)
    stride = 1
    for axis in reversed(range(len(split))):
        index = torch.arange(split[axis], dtype=torch.int64, device=block.device)
        if axis == dim + 1:
            index = head_tail_positions(whole[axis], world_size, head_tail, rank, block.device) if head_tail \
                else index + block_range(whole[axis], world_size, rank)[0]
        positions = positions + (index * stride).view([-1] + [1] * (len(split) - 1 - axis))
        stride = stride * whole[axis]
    return positions.reshape(block.shape)


def _all_equal(sizes) -> bool:
    """Blocks known to be of one size. Blocks of a symbolic length count as uneven (padding or split
    sizes of 0 cost little), so the graph holds for every length without a guard."""
    return not any(is_symbolic(size) for size in sizes) and len(set(sizes)) == 1


def gather_blocks(x: torch.Tensor, dim, outer, inner, length, world_size, group_name, head_tail: int = 0) -> torch.Tensor:
    """``gather_seq``'s forward alone (no autograd): every rank's block of a sequence of global ``length``,
    whole and in order (a head-tail layout's blocks put back in place). Uneven blocks travel padded to
    the largest, as all-gather needs equal sizes."""
    sizes = block_sizes(length, world_size)
    split = x.reshape(_split_seq(x.shape, dim, outer, inner))
    seq_axis = dim + 1
    even = _all_equal(sizes)
    if not even:
        padding = list(split.shape)
        padding[seq_axis] = sizes[0] - split.shape[seq_axis]
        split = torch.cat([split, split.new_zeros(padding)], seq_axis)
    gathered = _all_gather_dim0(split.movedim(seq_axis, 0), world_size, group_name)
    # gathered: [P * block, ...rest] with the ranks' blocks in rank order along dim 0
    if not even:
        gathered = torch.cat([gathered.narrow(0, rank * sizes[0], size) for rank, size in enumerate(sizes)])
    if head_tail:
        gathered = gathered.index_select(0, head_tail_order(length, head_tail, gathered.device))
    return _merge_seq(gathered.movedim(0, seq_axis), dim).contiguous()


class _ScatterSeq(torch.autograd.Function):
    """An input that holds its blocks (``boundary.GatheredOnUse``, a compiled graph's sequence-sharded
    output passed to the next compiled graph) gives this rank's block without a gather, and its
    gradient goes back the same way, as the blocks of a whole gathered only if read. Found by its
    ``own_block`` method: ``boundary`` builds on this module, not the other way round."""

    @staticmethod
    def forward(ctx, x, dim, outer, inner, rank, world_size, group_name, head_tail):
        length = x.shape[dim] // (outer * inner)
        ctx.args = (dim, outer, inner, length, world_size, group_name, head_tail)
        own_block = getattr(x, "own_block", None)
        block = own_block(dim, outer, inner, rank, world_size, group_name, head_tail) if own_block else None
        if block is None:
            ctx.lazy_whole = None
            return take_block(x, dim, outer, inner, rank, world_size, head_tail).contiguous()
        ctx.lazy_whole = x.lazy_whole_of()
        return block.view_as(block)

    @staticmethod
    def backward(ctx, grad):
        whole = ctx.lazy_whole(grad.contiguous()) if ctx.lazy_whole else gather_blocks(grad, *ctx.args)
        return (whole, None, None, None, None, None, None, None)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, outer, inner, length, rank, world_size, group_name, head_tail):
        ctx.args = (dim, outer, inner, rank, world_size, head_tail)
        return gather_blocks(x, dim, outer, inner, length, world_size, group_name, head_tail)

    @staticmethod
    def backward(ctx, grad):
        return (take_block(grad, *ctx.args).contiguous(), None, None, None, None, None, None, None, None)


class _ReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        return _all_reduce_sum(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over a group and divides it by ``divisor``."""

    @staticmethod
    def forward(ctx, x, group_name, divisor):
        ctx.group_name, ctx.divisor = group_name, divisor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = _all_reduce_sum(grad, ctx.group_name)
        return (total if ctx.divisor == 1 else total / ctx.divisor), None, None


def mean_over_group(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """The mean of ``x`` over a group's ranks (outside autograd)."""
    return _all_reduce_sum(x, group_name) / group_size


def average_grad(x, group_name: str, group_size: int):
    """Identity whose backward averages the gradient over the data-parallel replicas (DDP's rule)."""
    return _ReduceGrad.apply(x, group_name, group_size)


def scatter_seq(x, dim: int, outer: int, inner: int, rank, world_size: int, group_name: str, head_tail: int = 0):
    """Replicate -> this rank's sequence block (``Shard`` or ``MergedShard``; ``head_tail``: the ring's
    size where the layout is head-tail)."""
    return _ScatterSeq.apply(x, dim, outer, inner, rank, world_size, group_name, head_tail)


def gather_seq(x, dim: int, outer: int, inner: int, length: int, rank, world_size: int, group_name: str,
               head_tail: int = 0):
    """This rank's sequence block (of a sequence of global ``length``) -> the whole tensor on every rank."""
    return _GatherSeq.apply(x, dim, outer, inner, length, rank, world_size, group_name, head_tail)


def gather_rows(row: list[int], device, world_size: int, group_name: str) -> list[list[int]]:
    """Every rank's ``row`` of small integers, in rank order (one all-gather of a tensor)."""
    mine = torch.tensor([row], dtype=torch.int64, device=device)
    return _all_gather_dim0(mine, world_size, group_name).tolist()


def reduce_partial(x, group_name: str):
    """Partial sums -> their total on every rank."""
    return _ReducePartial.apply(x, group_name)


def sync_grad(x, group_name: str):
    """Identity whose backward sums the ranks' gradients of a replicated value."""
    return _ReduceGrad.apply(x, group_name, 1)


def _all_to_all(chunks: list[list[torch.Tensor]], received_shapes: list[list[list[int]]],
                group_name: str) -> list[list[torch.Tensor]]:
    """Send the tensors ``chunks[j]`` to rank j; return what each rank j sent here, shaped
    ``received_shapes[j]``. all_to_all_single has autograd registered by torch: its backward is the
    inverse all-to-all."""
    flat = torch.cat([chunk.reshape(-1) for sent in chunks for chunk in sent])
    received = [[math.prod(shape) for shape in shapes] for shapes in received_shapes]
    out = c10d_functional.all_to_all_single(flat, [sum(numels) for numels in received],
                                            [sum(chunk.numel() for chunk in sent) for sent in chunks], group_name)
    pieces = c10d_functional.wait_tensor(out).split([sum(numels) for numels in received])
    return [[part.view(shape) for part, shape in zip(piece.split(numels), shapes)]
            for piece, numels, shapes in zip(pieces, received, received_shapes)]


def _reshard(xs: list, from_dim: int, to_dim: int, from_lengths: list, rank, world_size: int,
             group_name: str) -> list[torch.Tensor]:
    """Each of ``xs`` holds this rank's block of ``from_dim`` (global size ``from_lengths[i]``) and all
    of ``to_dim``; each result holds all of ``from_dim`` and this rank's block of ``to_dim``, all by one
    all-to-all. Blocks may be uneven."""
    to_sizes = [block_sizes(x.shape[to_dim], world_size) for x in xs]
    from_sizes = [block_sizes(length, world_size) for length in from_lengths]
    if all(_all_equal(sizes) for sizes in to_sizes + from_sizes):
        return _reshard_even(xs, from_dim, to_dim, world_size, group_name)
    chunks = [list(x.split(sizes, to_dim)) for x, sizes in zip(xs, to_sizes)]

    def received_shape(i, source):
        shape = list(xs[i].shape)
        shape[to_dim], shape[from_dim] = to_sizes[i][rank], from_sizes[i][source]
        return shape

    pieces = _all_to_all([[split[j] for split in chunks] for j in range(world_size)],
                         [[received_shape(i, j) for i in range(len(xs))] for j in range(world_size)], group_name)
    return [torch.cat([pieces[j][i] for j in range(world_size)], from_dim) for i in range(len(xs))]


def _reshard_even(xs: list, from_dim: int, to_dim: int, world_size: int, group_name: str) -> list[torch.Tensor]:
    chunks = []  # each [P, ...]: chunk j goes to rank j
    for x in xs:
        size = x.shape[to_dim]
        chunks.append(x.reshape([*x.shape[:to_dim], world_size, size // world_size, *x.shape[to_dim + 1 :]])
                      .movedim(to_dim, 0))
    sent = chunks[0].contiguous() if len(xs) == 1 else torch.cat([c.reshape(world_size, -1) for c in chunks], 1)
    rows = [1] * world_size
    received = c10d_functional.wait_tensor(c10d_functional.all_to_all_single(sent, rows, rows, group_name))
    parts = [received] if len(xs) == 1 else [part.reshape(chunk.shape) for part, chunk in
                                             zip(received.split([c[0].numel() for c in chunks], 1), chunks)]
    results = []
    for part in parts:
        joined = part.movedim(0, from_dim)  # rank j's block of from_dim becomes its outer factor
        shape = list(joined.shape)
        shape[from_dim : from_dim + 2] = [shape[from_dim] * shape[from_dim + 1]]
        results.append(joined.reshape(shape))
    return results


def seq_to_heads(x, seq_dim: int, head_dim: int, seq_len: int, rank, world_size: int, group_name: str,
                 heads_outer: int = 1):
    """``[.., H, .., S/P, ..]`` -> ``[.., H/P, .., S, ..]``: the whole sequence (of global length
    ``seq_len``) for this rank's heads. Any Shard(a) -> Shard(b) conversion is this all-to-all.
    ``heads_outer`` > 1: the head dim holds ``[heads_outer, H]`` merged (Bloom's ``[B*H, S, D]``), and
    each of the ``heads_outer`` groups splits its heads over the ranks."""
    return _reshard_heads([x], seq_dim, head_dim, [seq_len], rank, world_size, group_name, heads_outer)[0]


def seq_to_heads_qkv(query, key, value, seq_dim: int, head_dim: int, seq_len: int, kv_seq_len: int, rank,
                     world_size: int, group_name: str, heads_outer: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`seq_to_heads` of an attention's query, key and value (of lengths ``seq_len``,
    ``kv_seq_len``) in one all-to-all: one buffer, one meeting of the ranks instead of three, the same
    bytes. Its backward is one all-to-all as well."""
    return tuple(_reshard_heads([query, key, value], seq_dim, head_dim, [seq_len, kv_seq_len, kv_seq_len], rank,
                                world_size, group_name, heads_outer))


def heads_to_seq(x, seq_dim: int, head_dim: int, heads: int, rank, world_size: int, group_name: str,
                 heads_outer: int = 1):
    """The inverse of :func:`seq_to_heads`: the same all-to-all with the two dims' roles swapped."""
    if heads_outer == 1:
        return _reshard([x], head_dim, seq_dim, [heads], rank, world_size, group_name)[0]
    apart = x.unflatten(head_dim, (heads_outer, -1))
    seq_dim += seq_dim > head_dim
    return _reshard([apart], head_dim + 1, seq_dim, [heads], rank, world_size, group_name)[0].flatten(
        head_dim, head_dim + 1)


def _reshard_heads(xs: list, seq_dim: int, head_dim: int, seq_lengths: list, rank, world_size: int,
                   group_name: str, heads_outer: int) -> list[torch.Tensor]:
    """Sequence blocks to head blocks, the heads split within each of ``heads_outer`` groups."""
    if heads_outer == 1:
        return _reshard(xs, seq_dim, head_dim, seq_lengths, rank, world_size, group_name)
    apart = [x.unflatten(head_dim, (heads_outer, -1)) for x in xs]
    seq_dim += seq_dim > head_dim
    return [x.flatten(head_dim, head_dim + 1)
            for x in _reshard(apart, seq_dim, head_dim + 1, seq_lengths, rank, world_size, group_name)]


def gather_kv_heads(x, seq_dim: int, head_dim: int, seq_len: int, heads: int, rank, world_size: int, group_name: str):
    """``[.., Hkv, .., S/P, ..]`` -> the whole sequence of the KV head of each of this rank's query heads
    (of ``heads``), in order: for fewer KV heads than ranks, or KV heads that do not split like the
    query heads. Ranks sharing a KV head each hold part of its gradient, so the backward is the
    all-gather's: a reduce-scatter that sums them."""
    whole = gather_blocks(x, seq_dim, 1, 1, seq_len, world_size, group_name)
    first, count = block_range(heads, world_size, rank)
    queries_per_kv = heads // x.shape[head_dim]
    if isinstance(first, torch.Tensor):
        index = (torch.arange(count, device=x.device) + first) // queries_per_kv
        return whole.index_select(head_dim, index)
    kv_index = [head // queries_per_kv for head in range(first, first + count)]
    if kv_index == list(range(kv_index[0], kv_index[0] + count)):
        return whole.narrow(head_dim, kv_index[0], count)
    return whole.index_select(head_dim, torch.tensor(kv_index, device=x.device))


def reblock_seq(x, dim: int, held: tuple, wanted: tuple, rank: int, world_size: int, group_name: str):
    """The rows of a sequence regrouped over the ranks: rank r holds the global rows ``held[r]`` and
    receives ``wanted[r]`` (each ``(first, count)``), each row from the rank that holds it, in one
    all-to-all. For ``x[:, 1:]`` of a sequence in balanced blocks, taken in the balanced blocks of its
    own length, that is one row across each rank boundary."""
    first = held[rank][0]
    chunks = []
    for want in wanted:
        start, count = _overlap(held[rank], want)
        chunks.append([x.narrow(dim, start - first if count else 0, count)])
    shapes = [[[*x.shape[:dim], _overlap(held[source], wanted[rank])[1], *x.shape[dim + 1:]]]
              for source in range(world_size)]
    return torch.cat([piece for (piece,) in _all_to_all(chunks, shapes, group_name)], dim)


def shift_seq(x, dim: int, shift: int, fill, rank, world_size: int, group_name: str):
    """The rank's block of the sequence moved by ``shift`` rows, as ``F.pad(x, (.., shift, -shift))``
    (``fill``, a value or a whole tensor of ``shift`` rows, entering at the start, or at the end for a
    negative shift) or ``torch.roll`` (``fill`` None: the rows leaving one end enter the other). The
    ``|shift|`` rows leaving each block are all-gathered and each rank takes its neighbour's: a few rows
    P times, and one collective the same on every rank whatever its place (an exchange that differs by
    rank would make the ranks' code differ). Every rank reads ``fill`` through the same ``where``, the
    rank at the start selecting it, so that a fill computed from parameters has one backward everywhere."""
    count, length = abs(shift), x.shape[dim]
    entering = _entering_rows(x, dim, shift, fill, rank, world_size, group_name)
    kept = x.narrow(dim, 0, length - count) if shift > 0 else x.narrow(dim, count, length - count)
    return torch.cat([entering, kept] if shift > 0 else [kept, entering], dim)


def rows_before(x, dim: int, count: int, rank, world_size: int, group_name: str):
    """The ``count`` rows of the sequence just before the rank's block (the last rows of the block before
    it; zeros before the first block): what a causal convolution reaches back to. ``shift_seq``'s
    exchange, without moving the block."""
    return _entering_rows(x, dim, count, 0.0, rank, world_size, group_name)


def _entering_rows(x, dim: int, shift: int, fill, rank, world_size: int, group_name: str):
    """The ``|shift|`` rows that enter the rank's block when the sequence moves by ``shift``: the ones
    leaving each block all-gathered, each rank taking its neighbour's (``fill`` at the sequence's end)."""
    count, length = abs(shift), x.shape[dim]
    leaving = x.narrow(dim, length - count, count) if shift > 0 else x.narrow(dim, 0, count)
    gathered = _all_gather_dim0(leaving.unsqueeze(0), world_size, group_name)
    source = (rank - (1 if shift > 0 else -1)) % world_size
    entering = narrow_at(gathered, 0, source, 1).squeeze(0)
    if fill is not None:
        keep = torch.as_tensor(rank != (0 if shift > 0 else world_size - 1), device=x.device)
        entering = torch.where(keep, entering, fill if isinstance(fill, torch.Tensor) else torch.full_like(entering, fill))
    return entering


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """``(first, count)`` of the rows both row ranges ``(first, count)`` hold."""
    start = max(a[0], b[0])
    return start, max(min(a[0] + a[1], b[0] + b[1]) - start, 0)


def add_previous_ranks_totals(local_cumsum, dim: int, rank, world_size: int, group_name: str):
    """A cumulative sum along the sharded sequence: this rank's local cumsum plus the totals of the
    ranks before it (their blocks come first). Gradients reach those ranks through the all-gather's
    reduce-scatter backward."""
    totals = local_cumsum.narrow(dim, local_cumsum.shape[dim] - 1, 1)
    gathered = _all_gather_dim0(totals.unsqueeze(0), world_size, group_name)
    before = torch.arange(world_size, device=gathered.device) < rank
    return local_cumsum + torch.where(before.view(-1, *[1] * totals.dim()), gathered, 0).sum(0)


class _GatherParameter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, shape, group_name, group_size, param_dtype, reduce_dtype, grad_divisor):
        ctx.args = (group_name, group_size, shard.dtype, reduce_dtype, group_size if grad_divisor is None else grad_divisor)
        shard = shard.to(param_dtype or shard.dtype)
        if not shape:  # a 0-d parameter, held whole
            return shard.clone()
        return _all_gather_dim0(shard, group_size, group_name).narrow(0, 0, shape[0])

    @staticmethod
    def backward(ctx, grad):
        group_name, group_size, shard_dtype, reduce_dtype, grad_divisor = ctx.args
        grad = grad.to(reduce_dtype or grad.dtype)
        if grad.dim() == 0:
            summed = _all_reduce_sum(grad, group_name)
        else:
            rows = -(-grad.shape[0] // group_size)
            padded = torch.nn.functional.pad(grad, [0, 0] * (grad.dim() - 1) + [0, rows * group_size - grad.shape[0]])
            summed = c10d_functional.wait_tensor(
                c10d_functional.reduce_scatter_tensor(padded.contiguous(), "sum", group_size, group_name))
        return (summed / grad_divisor).to(shard_dtype), None, None, None, None, None, None


@torch.compiler.allow_in_graph
def gather_parameter(local, shape: tuple[int, ...], group_name: str, group_size: int,
                     regather_in_backward: bool = False, param_dtype: torch.dtype | None = None,
                     reduce_dtype: torch.dtype | None = None, grad_divisor: int | None = None):
    """A ZeRO shard (this rank's rows of dim 0, ``sharding.shard_rows``, padded to the largest block)
    -> the full parameter of ``shape``, cast to ``param_dtype`` before the all-gather (mixed precision halves its bytes in bf16).
    Backward: the gradient, cast to ``reduce_dtype``, reduce-scattered into the shards, divided by
    ``grad_divisor`` (default N) and cast to the shard's dtype. Where every rank's gradient of the full
    parameter is the same whole gradient (``sync_grad`` summed the sequence ranks' shares), dividing by
    N leaves one copy per data-parallel replica, averaged as DDP does; where each rank holds only its
    share (ulysses_compile/passes/merge_gradient_reductions.py removed the ``sync_grad``), the divisor is the number of
    replicas. A 0-d parameter is held whole: its gradient is all-reduced and divided the same way.
    ``regather_in_backward`` (ZeRO stage 3) is read by ulysses_compile/passes/regather_parameters.py."""
    return _GatherParameter.apply(local, tuple(shape), group_name, group_size, param_dtype, reduce_dtype,
                                  grad_divisor)


COLLECTIVES = (gather_parameter, average_grad, gather_seq, reduce_partial, sync_grad, seq_to_heads, seq_to_heads_qkv,
               heads_to_seq, gather_kv_heads, reblock_seq, shift_seq, rows_before,
               add_previous_ranks_totals)


def sequence_subgroups(group_name: str, ulysses: int) -> tuple[str | None, str]:
    """The names of this rank's two subgroups of the group ``group_name`` under a plan of Ulysses over
    ``ulysses`` ranks and a ring over the rest: its Ulysses group (the ``ulysses`` consecutive ranks
    holding one chunk of the sequence, in the graph's layout; None for one rank) and its ring group (the
    ranks at its own place in every Ulysses group, one per chunk). Created on first use by their members, under
    names the same on every rank of the group (so the ranks' code is one, and the members meet)."""
    parent = _resolve_process_group(group_name)
    ranks = torch.distributed.get_process_group_ranks(parent)
    row, column = divmod(parent.rank(), ulysses)
    digest = hashlib.sha1(f"{group_name} {ulysses}".encode()).hexdigest()[:12]
    names = []
    for kind, members in (("heads", ranks[row * ulysses:(row + 1) * ulysses]), ("ring", ranks[column::ulysses])):
        name = f"ulysses_{kind}{len(members)}_{digest}"
        if len(members) == 1:
            names.append(None)
            continue
        try:
            found = torch.distributed.get_process_group_ranks(_resolve_process_group(name))
        except (RuntimeError, ValueError):  # not made in this process yet (nor since the groups were destroyed)
            # made under a name of its members (where they meet), found by the name common to every rank
            _register_process_group(name, new_group_named(members, f"{name}_{'_'.join(map(str, members))}"))
        else:
            if found != members:
                raise InternalError(f"process group {name} holds ranks {found}, expected {members}")
        names.append(name)
    return names[0], names[1]


def ranks_per_node(group_name: str) -> int:
    """The most consecutive ranks of the group that share a node wherever they start at a multiple of
    it: a node holds the global ranks ``n * LOCAL_WORLD_SIZE ...`` (torchrun's numbering); without
    torchrun's variable, the whole group."""
    ranks = torch.distributed.get_process_group_ranks(_resolve_process_group(group_name))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if local <= 0:
        return len(ranks)
    return max(size for size in range(1, len(ranks) + 1) if len(ranks) % size == 0
               and all(len({rank // local for rank in ranks[start:start + size]}) == 1
                       for start in range(0, len(ranks), size)))


def ring_rank(group_name: str) -> tuple[int, int]:
    """``(this rank's position, the ring's size)`` in the ring group ``group_name``."""
    group = _resolve_process_group(group_name)
    return group.rank(), group.size()


def ring_shift(tensors: list[torch.Tensor], group_name: str, tag: int):
    """Send ``tensors`` to the next rank of the ring ``group_name`` and receive the previous rank's
    (of the same shapes), started now; returns the function that waits for them and returns them.
    Plain point-to-point sends: they run inside ring attention's ops, which AOTAutograd calls, not
    traces. Shifts in flight at once carry different ``tag``s."""
    group = _resolve_process_group(group_name)
    rank, size = group.rank(), group.size()
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    operations = []
    for sent, into in zip(tensors, received):
        operations.append(torch.distributed.P2POp(torch.distributed.isend, sent.contiguous(),
                                                  group=group, group_peer=(rank + 1) % size, tag=tag))
        operations.append(torch.distributed.P2POp(torch.distributed.irecv, into, group=group,
                                                  group_peer=(rank - 1) % size, tag=tag))
    works = torch.distributed.batch_isend_irecv(operations)

    def arrived() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        return received

    return arrived


def gather_objects(obj, group) -> list:
    """Every rank's ``obj`` (small, picklable), in rank order: a check outside the compiled graphs."""
    gathered = [None] * group.size()
    torch.distributed.all_gather_object(gathered, obj, group=group)
    return gathered


def insert_call(graph: fx.Graph, fn, args: tuple, *, before: fx.Node | None = None, after=None) -> fx.Node:
    """Create a call of one of this module's functions at a point; never among the placeholders.
    Arguments after the tensor are passed by keyword, so the graph code reads what each one is."""
    if after is not None and after.op == "placeholder":  # after the placeholders and the rank read
        after = [n for n in graph.nodes if n.op == "placeholder"][-1]
        after = next(iter(graph.find_nodes(op="call_function", target=rank_of_group)), after)
    anchor = graph.inserting_before(before) if before is not None else graph.inserting_after(after)
    names = list(inspect.signature(fn).parameters)[1:]
    with anchor:
        node = graph.call_function(fn, args[:1])
    node.kwargs = dict(zip(names, size_arg(graph, args[1:], before=node)))
    # AOTAutograd copies "custom" and the module stack onto the ops it traces from this node (explain).
    node.meta["custom"] = {"ulysses_collective": fn.__name__}
    if isinstance(args[0], fx.Node) and "nn_module_stack" in args[0].meta:
        node.meta["nn_module_stack"] = args[0].meta["nn_module_stack"]
    return node
