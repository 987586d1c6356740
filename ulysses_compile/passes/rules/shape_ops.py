"""Views, dim shuffles, indexing, splits and concatenation: where the sequence dim goes, and its local size.

A view keeps the sequence sharded when the sequence stays inside one output dim, possibly merged with
neighbours (``[B, S, V] -> [B*S, V]`` gives ``MergedShard(0, outer=B, inner=1)``). Its shape argument
is rewritten to the local shape. Slices and shifts of the sequence stay sharded (``reblock_seq``,
``shift_seq``; a position inside one rank's block is that rank's part of a sum); a step other than 1 or
a split across dims falls back.
"""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.fx as fx

from ulysses_compile.core.collectives import insert_call, reblock_seq, rows_before, shift_seq
from ulysses_compile.core.compat import add_batch_dim, remove_batch_dim, statically_known_true
from ulysses_compile.core.fx_graph import (
    erase_unused,
    index_entries,
    insert_part,
    method_or_function_args,
    normalize_dim,
    permute_dims,
)
from ulysses_compile.core.ops import CASTS, spellings
from ulysses_compile.core.runtime import causal_conv1d, owned_by, summed_away, zero_rows
from ulysses_compile.core.sharding import (
    PARTIAL,
    RANK_SPECIFIC,
    REPLICATE,
    NodeSharding,
    Shard,
    block_range,
    block_sizes,
    is_rank_local,
    local_shape,
    place,
    seq_factors,
    seq_shard,
    sharding_of,
    with_dim,
)
from ulysses_compile.core.sizes import is_symbolic, same_size, size_arg
from ulysses_compile.passes.rules import Decision, contiguous_blocks_only, register

# The op tables the rules register and sequence_dims.py walks back through.
VIEWS = spellings("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as")
TRANSPOSES = spellings("transpose", "swapaxes", "swapdims")
SPLITS = spellings("split", "chunk", "tensor_split")
UNBINDS = spellings("unbind")
# Ops whose result may share storage with their first argument, so that an in-place write into one is
# seen through the other. Over-inclusive on purpose (reshape, contiguous and casts may copy): a false
# alias only costs a conversion placed later, a missed one a stale read.
ALIASING = frozenset({
    *VIEWS, *TRANSPOSES, *SPLITS, *UNBINDS, *CASTS, operator.getitem, getattr, summed_away, zero_rows, "unfold", *spellings(
        "expand", "expand_as", "permute", "movedim", "moveaxis", "unsqueeze", "squeeze", "narrow", "select", "t",
        "detach", "as_strided", "diagonal", "contiguous", "view_as_real", "view_as_complex", "ravel",
        "broadcast_to", "split_with_sizes", "adjoint", "conj", "real", "imag", "hsplit", "vsplit", "dsplit",
        "unsafe_split", "unsafe_chunk", "atleast_1d", "atleast_2d", "atleast_3d"),
})


def _flat_position(shape, dim, outer, inner):
    return math.prod(shape[:dim]) * outer, shape[dim] // (outer * inner)


def view_placement(in_shape, out_shape, factors):
    """Where a sharded sequence lands after a view from ``in_shape`` to ``out_shape``, or None."""
    dim, outer, inner = factors
    before, seq = _flat_position(in_shape, dim, outer, inner)
    cum = 1
    for out_dim, size in enumerate(out_shape):
        if cum * size > before:
            if before % cum or size % ((before // cum) * seq):
                return None
            new_outer = before // cum
            return seq_shard(out_dim, new_outer, size // (new_outer * seq))
        cum *= size
    return None


def _localize_shape(method: str):
    """Rewrite a view, reshape or expand to the local shape its placement implies."""

    def localize(node: fx.Node, sharding, ctx) -> None:
        shape = local_shape(sharding.global_value.shape, sharding.output, ctx.world_size, ctx.rank)
        node.op, node.target = "call_method", method
        node.args, node.kwargs = (node.args[0], size_arg(node.graph, shape, before=node)), {}

    return localize


@register(*VIEWS)
def view_rule(node, view):
    source = node.args[0]
    factors = view.sharded(source)
    out = view.value(node)
    if factors is None or not isinstance(out, torch.Tensor):
        return None
    placement = view_placement(tuple(view.value(source).shape), tuple(out.shape), factors)
    if placement is None:
        return None
    method = "view" if node.target in ("view", "view_as") else "reshape"
    return Decision(placement, {source: view.placement(source)}, _localize_shape(method))


@register("expand")
def expand_rule(node, view):
    source = node.args[0]
    factors = view.sharded(source)
    out = view.value(node)
    if factors is None:
        return None
    dim, outer, inner = factors
    out_dim = dim + out.dim() - view.value(source).dim()
    if out.shape[out_dim] != view.value(source).shape[dim]:
        return None
    return Decision(with_dim(view.placement(source), out_dim), {source: view.placement(source)},
                    _localize_shape("expand"))


@register("expand_as")
def expand_as_rule(node, view):
    """``x.expand_as(other)`` reads only ``other``'s shape (``F.normalize``'s denominator): as ``expand``
    of a sharded ``x``, or of an ``x`` broadcast (size 1) along the dim ``other`` holds sharded; either
    way the local ``expand`` to the block's shape, ``other`` left where it is."""
    source, other = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    if not isinstance(other, fx.Node):
        return None
    kept = {other: view.actual_placement(other)}
    if view.sharded(source) is not None:
        decision = expand_rule(node, view)
        return None if decision is None else Decision(decision.output, {**kept, **decision.inputs}, decision.localize)
    factors = view.sharded(other)
    if factors is None or view.placement(source) != REPLICATE:
        return None
    dim = factors[0] - (view.value(other).dim() - view.value(source).dim())
    if dim >= 0 and view.value(source).shape[dim] != 1:
        return None
    return Decision(view.placement(other), {source: REPLICATE, **kept}, _localize_shape("expand"))


def _global_size(node: fx.Node, sharding, ctx) -> None:
    """``x.size()`` / ``x.size(d)`` of a sharded ``x`` (Dynamo records them when sizes are symbolic):
    the program asked for the global size, so compute it from the graph's size inputs instead."""
    size = size_arg(node.graph, tuple(sharding.global_value) if isinstance(sharding.global_value, torch.Size)
                    else sharding.global_value, before=node)
    if isinstance(size, tuple):
        with node.graph.inserting_before(node):
            size = node.graph.call_function(torch.Size, (list(size),))
    node.replace_all_uses_with(size)
    node.graph.erase_node(node)


@register("new_empty", "new_zeros", "new_ones", "new_full")
def new_tensor_rule(node, view):
    """``x.new_empty(sizes)`` with x's sharded sequence dim at the same place: a fresh tensor of no
    values yet, so each rank makes its own block of it, as DeepSeek-V3 makes the buffer it writes its
    keys into. Otherwise (``new_zeros``, ``new_ones``, ``new_full``: a buffer filled by shifted writes,
    T5's labels, must stay whole) the whole tensor, made from the global sizes on every rank: x's values
    are not read (only its dtype and device), so x is not gathered for it."""
    source = node.args[0]
    factors = view.sharded(source) if is_rank_local(view.actual_placement(source)) else None
    out, value = view.value(node), view.value(source)
    if node.target == "new_empty" and factors is not None and factors[1:] == (1, 1) and isinstance(out, torch.Tensor) \
            and out.dim() == value.dim() and same_size(out.shape[factors[0]], value.shape[factors[0]]):
        return Decision(view.placement(source), {source: view.placement(source)}, _localize_new_tensor)
    return Decision(REPLICATE, {source: view.placement(source)})


def _localize_new_tensor(node: fx.Node, sharding, ctx) -> None:
    shape = size_arg(node.graph, local_shape(sharding.global_value.shape, sharding.output, ctx.world_size, ctx.rank),
                     before=node)
    if "size" in node.kwargs:
        node.kwargs = {**node.kwargs, "size": tuple(shape)}
    else:
        node.args = (node.args[0], tuple(shape))


@register("size")
def size_rule(node, view):
    source = node.args[0]
    if view.sharded(source) is None:
        return None
    return Decision(None, {source: view.placement(source)}, _global_size)


def _dim_map_rule(mapping):
    """A rule for ops that only move dims: ``mapping(node, in_ndim, out_ndim)`` maps input dim -> output dim."""

    def rule(node, view):
        source = node.args[0] if node.args else node.kwargs.get("input")
        factors = view.sharded(source)
        if factors is None:
            return None
        in_value, out = view.value(source), view.value(node)
        out_dim = mapping(node, factors[0], in_value, out)
        if out_dim is None:
            return None
        return Decision(with_dim(view.placement(source), out_dim), {source: view.placement(source)})

    return rule


def _transpose(node, dim, in_value, out):
    args = method_or_function_args(node, ("input", "dim", "dim1"))
    a, b = (normalize_dim(args[name], in_value.dim()) for name in ("dim", "dim1"))
    return b if dim == a else a if dim == b else dim


def _permute(node, dim, in_value, out):
    return [normalize_dim(d, in_value.dim()) for d in permute_dims(node)].index(dim)


def _movedim(node, dim, in_value, out):
    args = method_or_function_args(node, ("input", "dim", "dim1"))
    src, dst = args["dim"], args["dim1"]
    src_list = [normalize_dim(d, in_value.dim()) for d in (src if isinstance(src, (list, tuple)) else [src])]
    dst_list = [normalize_dim(d, in_value.dim()) for d in (dst if isinstance(dst, (list, tuple)) else [dst])]
    rest = iter([d for d in range(in_value.dim()) if d not in src_list])
    order = [None] * in_value.dim()
    for s, d in zip(src_list, dst_list):
        order[d] = s
    order = [s if s is not None else next(rest) for s in order]
    return order.index(dim)


def _unsqueeze(node, dim, in_value, out):
    new = normalize_dim(method_or_function_args(node, ("input", "dim"))["dim"], out.dim())
    return dim + 1 if new <= dim else dim


def _squeeze(node, dim, in_value, out):
    dims = method_or_function_args(node, ("input", "dim")).get("dim")
    if dims is None:
        squeezed = [d for d in range(in_value.dim()) if in_value.shape[d] == 1]
    else:
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        squeezed = [d for d in (normalize_dim(d, in_value.dim()) for d in dims) if in_value.shape[d] == 1]
    if dim in squeezed:
        return None
    return dim - sum(1 for d in squeezed if d < dim)


def _repeat_interleave(node, dim, in_value, out):
    """``cos.repeat_interleave(2, dim=-1)`` (interleaved RoPE): each element repeated along another dim."""
    args = method_or_function_args(node, ("input", "repeats", "dim"))
    along = args.get("dim")
    if not isinstance(args.get("repeats"), int) or along is None:
        return None
    return dim if normalize_dim(along, in_value.dim()) != dim and in_value.dim() == out.dim() else None


@register("repeat")
def repeat_rule(node, view):
    """``x.repeat(*sizes)``: tiles. Repeated r times along the sequence (a copy of the tokens per
    expert, as Llama 4's MoE makes), the rank's block recurs in each tile: ``outer * r``."""
    source = node.args[0]
    factors = view.sharded(source)
    if len(node.args) < 2:
        return None
    sizes = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (list, tuple)) else node.args[1]
    if factors is None or not all(isinstance(size, int) for size in sizes):
        return None
    dim, outer, inner = factors
    out_dim = dim + len(sizes) - view.value(source).dim()
    return Decision(seq_shard(out_dim, outer * sizes[out_dim], inner), {source: view.placement(source)})


@register(*spellings("repeat_interleave"))
def repeat_interleave_rule(node, view):
    """Along another dim, the dims stay; along the sequence (a token per top-k slot: ``[T, H]`` ->
    ``[T*k, H]``) each token's copies sit next to it, merged after the sequence: ``inner * k``."""
    source = node.args[0] if node.args else node.kwargs["input"]
    factors = view.sharded(source)
    args = method_or_function_args(node, ("input", "repeats", "dim"))
    if factors is None or not isinstance(args.get("repeats"), int) or args.get("dim") is None:
        return None
    value = view.value(source)
    if normalize_dim(args["dim"], value.dim()) != factors[0]:
        return _dim_map_rule(_repeat_interleave)(node, view)
    if "output_size" in node.kwargs:
        return None
    dim, outer, inner = factors
    return Decision(seq_shard(dim, outer, inner * args["repeats"]), {source: view.placement(source)})


def _slice_apart(node, dim, in_value, out):
    """``aten.slice(x, dim, start, end, step)`` along a dim that is not the sharded one (the odd and even
    positions torch's generic associative scan takes along a sequence held whole)."""
    sliced = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return None if normalize_dim(sliced, in_value.dim()) == dim else dim


def _add_batch_dim(node, dim, in_value, out):
    """vmap's ``_add_batch_dim(x, batch_dim, level)``: x seen without its batch dim, which must not be the
    sharded one."""
    batch_dim = normalize_dim(node.args[1], in_value.dim())
    return None if dim == batch_dim else dim - (dim > batch_dim)


def _remove_batch_dim(node, dim, in_value, out):
    """vmap's ``_remove_batch_dim(x, level, batch_size, out_dim)``: the batch dim back at ``out_dim``."""
    return dim + (dim >= normalize_dim(node.args[3], out.dim()))


def _complex_view(node, dim, in_value, out):
    """``view_as_complex`` drops the trailing pair dim, ``view_as_real`` adds it: other dims stay."""
    return dim if dim < min(in_value.dim(), out.dim()) else None


register(*TRANSPOSES)(_dim_map_rule(_transpose))
register(torch.ops.aten.slice, torch.ops.aten.slice.Tensor)(_dim_map_rule(_slice_apart))
register(add_batch_dim)(_dim_map_rule(_add_batch_dim))
register(remove_batch_dim)(_dim_map_rule(_remove_batch_dim))
register(*spellings("view_as_complex", "view_as_real"))(_dim_map_rule(_complex_view))
register(*spellings("permute"))(_dim_map_rule(_permute))
register(*spellings("movedim", "moveaxis"))(_dim_map_rule(_movedim))
register(*spellings("unsqueeze"))(_dim_map_rule(_unsqueeze))
register(*spellings("squeeze"))(_dim_map_rule(_squeeze))


def _is_full_slice(entry, size) -> bool:
    return (
        isinstance(entry, slice)
        and entry.start in (None, 0)
        and (entry.stop is None or statically_known_true(_size_value(entry.stop) >= size))
        and entry.step in (None, 1)
    )


def _size_value(arg):
    """A slice bound as a number: an int, or the SymInt a size node computes."""
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg


@register(operator.getitem)
def getitem_rule(node, view):
    source, index = node.args
    placement = view.placement(source)
    if isinstance(placement, tuple):
        return Decision(placement[index], {})
    if view.sharded(source) is None:
        return _table_lookup(view, source, index)
    return _indexed(view, source, index)


def _table_lookup(view, table, index) -> Decision | None:
    """``table[ids]`` of a replicated table at sequence-sharded ids (an expert's weight per token): the
    ids' dims come first, so the output is sharded as the ids are."""
    entries = index_entries(index, view.value(table).dim()) if not isinstance(index, fx.Node) else [index]
    ids, rest = entries[0], entries[1:]
    if not isinstance(ids, fx.Node) or view.sharded(ids) is None or any(entry != slice(None) for entry in rest):
        return None
    return Decision(view.placement(ids), {table: REPLICATE, ids: view.placement(ids)})


@register(operator.setitem)
def setitem_rule(node, view):
    """``x[index] = value`` with the index leaving the sequence whole: each rank writes its block."""
    target, index, value = node.args
    if _is_aligned_mask(view, target, index) and not view.is_tensor(value):
        return Decision(view.placement(target), {target: view.placement(target), index: view.placement(target)})
    region = _indexed(view, target, index)
    if region is None or region.localize is not None:
        return None
    region_value = view.value(target)[index]
    demands = {target: view.placement(target)}
    if view.is_tensor(value):
        value_dim = region.output.dim - (region_value.dim() - view.value(value).dim())
        size = view.value(value).shape[value_dim] if value_dim >= 0 else 1
        demands[value] = with_dim(region.output, value_dim) if size == region_value.shape[region.output.dim] \
            and size > 1 else REPLICATE
    return Decision(view.placement(target), demands)


def _is_aligned_mask(view, target, index) -> bool:
    """``x[mask] = c`` with a boolean mask over x's leading dims, sharded as x is or whole (then sliced to
    x's block, as Gemma 3 masks its image tokens in the ids): a masked fill."""
    mask = view.value(index)
    return isinstance(index, fx.Node) and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool \
        and view.sharded(target) is not None and view.sharded(target)[0] < mask.dim() \
        and view.placement(index) in (view.placement(target), REPLICATE) \
        and tuple(mask.shape) == tuple(view.value(target).shape[:mask.dim()])


def _indexed(view, source, index) -> Decision | None:
    """The placement of ``source[index]`` for a sequence-sharded ``source``."""
    placement = view.placement(source)
    factors = view.sharded(source)
    if factors is None:
        return None
    dim = factors[0]
    value = view.value(source)
    entries = list(index) if isinstance(index, tuple) else [index]
    lists = [e for e in entries if isinstance(e, list)]
    if any(isinstance(e, (fx.Node, torch.Tensor)) for e in entries) or len(lists) > 1:
        return None
    if lists and not all(isinstance(i, int) for i in lists[0]):
        return None  # one 1-D list of ints indexes in place, like a slice; anything else reorders dims
    entries = index_entries(tuple(entries), value.dim())
    in_dim = out_dim = 0
    for position, entry in enumerate(entries):
        if entry is None:
            out_dim += 1
            continue
        if in_dim == dim:
            if isinstance(entry, int) and factors[1:] == (1, 1):
                localize = functools.partial(_localize_position, entries=entries, position=position,
                                             out_dim=out_dim, length=value.shape[dim])
                return Decision(PARTIAL, {source: placement}, localize)
            if not _is_full_slice(entry, value.shape[dim]):
                return _sequence_slice(view, placement, value.shape[dim], entries, position, out_dim, source)
            return Decision(with_dim(placement, out_dim), {source: placement})
        if isinstance(entry, (slice, list)):
            out_dim += 1
        in_dim += 1
    return None


def _sequence_slice(view, placement, length, entries, position, out_dim, source) -> Decision | None:
    """``x[..., a:b, ...]`` of a sequence in balanced blocks: the slice in the balanced blocks of its own
    length, each rank receiving the few rows its new block takes from a neighbour (``reblock_seq``): a
    one-token shift (``x[:, 1:] + x[:, :-1]``, ``logits[:, :-1]``) moves one row per rank boundary."""
    entry = entries[position]
    bounds = (entry.start, entry.stop) if isinstance(entry, slice) else ()
    # Only a source already in blocks (not one offered sharded to start sharding from, nor a partial
    # value completed for the rule): where sharding starts, the slice's source is taken in blocks instead.
    if not bounds or entry.step not in (None, 1) or view.actual_placement(source) != placement \
            or seq_factors(placement)[1:] != (1, 1) or is_symbolic(length) \
            or any(bound is not None and not isinstance(bound, int) for bound in bounds):
        return None
    start, stop, _ = entry.indices(length)
    if (start, stop) == (0, length):
        return Decision(with_dim(placement, out_dim), {source: placement})
    held = tuple(block_range(length, view.world_size, rank) for rank in range(view.world_size))
    owners = [rank for rank, (first, count) in enumerate(held) if first <= start and stop <= first + count]
    if owners and stop > start:
        # Rows inside one rank's block (x[:, :1], x[:, -1:]): that rank's part of a sum, the others' zeros.
        localize = functools.partial(_localize_owned_rows, entries=entries, position=position, out_dim=out_dim,
                                     owner=owners[0], rows=(start - held[owners[0]][0], stop - start), length=length)
        return Decision(PARTIAL, {source: placement}, localize)
    # Every rank sends and receives rows (an empty exchange would let the partitioner place it apart on
    # that rank): the slice spans every rank's block and is at least as long as there are ranks.
    if stop - start < view.world_size or any(first + count <= start or first >= stop for first, count in held):
        return None
    wanted = tuple((start + first, count) for first, count in
                   (block_range(stop - start, view.world_size, rank) for rank in range(view.world_size)))
    localize = functools.partial(_localize_sequence_slice, entries=entries, position=position,
                                 dim=seq_factors(placement)[0], held=held, wanted=wanted)
    return Decision(with_dim(placement, out_dim), {source: placement}, localize, copies=True)


@contiguous_blocks_only("a slice of the sequence, whose rows move between neighbouring blocks")
def _localize_sequence_slice(node: fx.Node, sharding, ctx, *, entries, position, dim, held, wanted) -> None:
    source = node.args[0]
    moved = insert_call(node.graph, reblock_seq, (source, dim, held, wanted, ctx.rank, ctx.world_size, ctx.group_name),
                        before=node)
    start, length = wanted[0][0], sum(count for _, count in wanted)
    place(moved, NodeSharding(Shard(dim), sharding_of(source).global_value.narrow(dim, start, length),
                              {source: Shard(dim)}))
    entries = list(entries)
    entries[position] = slice(None)
    node.args = (moved, tuple(entries))
    place(node, NodeSharding(sharding.output, sharding.global_value, {moved: Shard(dim)}))


@contiguous_blocks_only("rows at fixed positions, taken by the rank whose block holds them")
def _localize_owned_rows(node: fx.Node, sharding, ctx, *, entries, position, out_dim, owner, rows, length) -> None:
    """``x[..., a:b, ...]`` inside the block of rank ``owner``: it takes its rows, the other ranks
    contribute zeros connected to ``x`` (so every rank's backward runs the same collectives)."""
    first, count = rows
    entries = list(entries)
    entries[position] = slice(first, first + count)
    _owner_takes(node, sharding, ctx, entries, position, owner, length, zero_rows, out_dim, count)


@contiguous_blocks_only("one position, taken by the rank whose block holds it")
def _localize_position(node: fx.Node, sharding, ctx, *, entries, position, out_dim, length) -> None:
    """``x[..., i, ...]`` at one sequence position: its owner takes it, the other ranks contribute zeros,
    so the partial values sum to the global result (pooling on the first or last token). Elsewhere the
    position becomes an empty slice summed away: zeros still connected to ``x`` (so every rank's backward
    runs the same collectives), also on a rank whose block is empty."""
    index = entries[position] % length
    starts = [block_range(length, ctx.world_size, rank)[0] for rank in range(ctx.world_size)]
    owner = max(rank for rank, start in enumerate(starts) if start <= index)
    entries = list(entries)
    entries[position] = size_arg(node.graph, index - starts[owner], before=node)
    _owner_takes(node, sharding, ctx, entries, position, owner, length, summed_away, out_dim)


def _owner_takes(node: fx.Node, sharding, ctx, entries: list, position: int, owner: int, length: int, zeros,
                 *args) -> None:
    """``node`` indexing ``entries`` (at the owner's rows) on rank ``owner``, zeros connected to its source
    elsewhere. Where the blocks are of one size every rank indexes its own block alike and keeps the result
    where it is the owner (``owned_by``): one code on every rank. Otherwise, or where the source is written
    in place (the owner's result must stay a view of it), the other ranks take an empty slice made
    ``zeros(empty, *args)``."""
    rank = ctx.rank_for(node.graph, length)
    per_rank = isinstance(rank, int) or _written_in_place(node)
    if per_rank and ctx.rank != owner:
        entries[position] = slice(0, 0)
    node.args = (node.args[0], tuple(entries))
    if not per_rank:
        _call_on_part(node, sharding, owned_by, rank, owner)
        return
    node.meta[RANK_SPECIFIC] = True
    if ctx.rank != owner:
        _call_on_part(node, sharding, zeros, *args)


def _written_in_place(node: fx.Node) -> bool:
    """Whether an in-place op writes into the storage ``node`` views (``in_place_writes``' analysis)."""
    # imported here: in_place_writes reads this module's ALIASING
    from ulysses_compile.passes.in_place_writes import alias_bases, written_bases

    bases = alias_bases(node.graph)
    return bases[node] in written_bases(node.graph, bases)


def _call_on_part(node: fx.Node, sharding, fn, *args) -> None:
    """``node``'s indexing kept as a part (the rank's own rows, or an empty slice: no global value), and
    ``node`` the call ``fn(part, *args)`` connected to the source, in ``node``'s placement."""
    part = insert_part(node, node.op, node.target, node.args, node.kwargs)
    place(part, NodeSharding(None, None, sharding.inputs))
    node.op, node.target, node.args, node.kwargs = "call_function", fn, (part, *args), {}
    place(node, NodeSharding(sharding.output, sharding.global_value))


def _split_dim(node):
    names = ("input", "dim") if node.target in ("unbind", torch.unbind) else ("input", "sections", "dim")
    return method_or_function_args(node, names, {"dim": 0})["dim"]


def _split_at_the_ends(node, view, dim: int) -> Decision | None:
    """``torch.tensor_split(x, [S], dim=1)`` with S the sequence's whole length (transformers' Mamba 2
    keeping its last positions for a step-by-step scan, none in training): one part is the sequence,
    held as it is, the others empty, on every rank; the local call cuts the rank's block the same way."""
    if node.target not in (torch.tensor_split, "tensor_split"):
        return None
    source = node.args[0]
    cuts = node.args[1] if len(node.args) > 1 else next(
        (node.kwargs[name] for name in ("indices", "indices_or_sections", "tensor_indices_or_sections")
         if name in node.kwargs), None)
    length = view.value(source).shape[dim]
    if not isinstance(cuts, (list, tuple)) or any(
            not (same_size(view.value(cut), 0) or same_size(view.value(cut), length)) for cut in cuts):
        return None
    placement = view.placement(source)
    return Decision(tuple(REPLICATE if same_size(part.shape[dim], 0) else placement for part in view.value(node)),
                    {source: placement})


@register(*SPLITS, *UNBINDS)
def split_rule(node, view):
    source = node.args[0]
    factors = view.sharded(source)
    outs = view.value(node)
    if factors is None or not isinstance(outs, (tuple, list)):
        return None
    dim = normalize_dim(_split_dim(node), view.value(source).dim())
    if dim == factors[0]:
        return _split_at_the_ends(node, view, dim)
    placement = view.placement(source)
    if node.target in ("unbind", torch.unbind):
        placement = with_dim(placement, factors[0] - (1 if dim < factors[0] else 0))
    return Decision(tuple(placement for _ in outs), {source: view.placement(source)})


def _is_legacy_empty(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == 0


@register(*spellings("cat", "concat", "concatenate", "stack"))
def cat_rule(node, view):
    args = method_or_function_args(node, ("tensors", "dim"), {"dim": 0})
    tensors, dim = args["tensors"], args["dim"]
    parts = [t for t in tensors if not _is_legacy_empty(view.value(t))]
    sharded = [view.placement(t) for t in parts if view.sharded(t) is not None]
    if not sharded:
        return None
    ndim = view.value(parts[0]).dim()
    stacking = node.target is torch.stack
    dim = normalize_dim(dim, ndim + 1 if stacking else ndim)
    if any(p != sharded[0] for p in sharded):
        # Parts split along different dims (a key/value cache on its heads joined by the new positions'
        # keys in sequence blocks): all are taken to the one split that is not along the joined dim.
        across = {p for p in sharded if seq_factors(p)[0] != dim}
        if stacking or len(across) != 1:
            return None
        (target,) = across
        return Decision(target, {t: target for t in parts})
    seq_dim = sharded[0].dim
    if not stacking and dim == seq_dim:
        if len(parts) == 2:
            return _shift_by_cat(view, *parts, dim)
        if len(parts) != 1:
            return None
        return Decision(sharded[0], {parts[0]: sharded[0]})
    out_placement = with_dim(sharded[0], seq_dim + 1 if stacking and dim <= seq_dim else seq_dim)
    return Decision(out_placement, {t: sharded[0] for t in parts})


@register(*spellings("pad"))
def pad_rule(node, view):
    """``F.pad`` of a sharded sequence: other dims padded on each block; on the sequence, a shift by k
    tokens (``F.pad(x, (0, 0, k, -k))``, x-transformers' and RWKV's token shift) takes k rows from the
    neighbouring block (``shift_seq``), never the sequence."""
    args = method_or_function_args(node, ("input", "pad", "mode", "value"), {"mode": "constant", "value": None})
    source, pads = args["input"], args["pad"]
    factors = view.sharded(source)
    if factors is None or factors[1:] != (1, 1) or args["mode"] != "constant" or not isinstance(pads, (tuple, list)) \
            or not all(isinstance(amount, int) for amount in pads):
        return None
    dim, ndim = factors[0], view.value(source).dim()
    at = 2 * (ndim - 1 - dim)
    before, after = (pads[at], pads[at + 1]) if at + 1 < len(pads) else (0, 0)
    if (before, after) == (0, 0):
        return Decision(view.placement(source), {source: view.placement(source)})
    if before != -after or not _shift_fits(view, view.value(source).shape[dim], before):
        return None  # a pad that grows or shrinks the sequence
    localize = functools.partial(_localize_shift, dim=dim, shift=before, fill=args["value"] or 0.0,
                                 sequence_pad=(at, at + 1))
    return Decision(view.placement(source), {source: view.placement(source)}, localize)


@register(*spellings("roll"))
def roll_rule(node, view):
    """``torch.roll(x, k, dims=seq)``: the rows leaving one end enter the other, k rows between neighbours."""
    args = method_or_function_args(node, ("input", "shifts", "dims"), {"dims": None})
    source, shifts, dims = args["input"], args["shifts"], args["dims"]
    factors = view.sharded(source)
    shifts, dims = (shifts if isinstance(shifts, (tuple, list)) else (shifts,)), \
        (dims if isinstance(dims, (tuple, list)) else (dims,))
    if factors is None or factors[1:] != (1, 1) or len(shifts) != 1 or len(dims) != 1 or dims[0] is None \
            or not isinstance(shifts[0], int):
        return None
    source_value = view.value(source)
    dim = factors[0]
    if normalize_dim(dims[0], source_value.dim()) != dim:
        return Decision(view.placement(source), {source: view.placement(source)})
    length = source_value.shape[dim]
    if shifts[0] == 0:
        return Decision(view.placement(source), {source: view.placement(source)})
    if is_symbolic(length):
        return None
    shift = (shifts[0] + length // 2) % length - length // 2  # the same roll, by at most half the length
    if not _shift_fits(view, length, shift):
        return None
    return Decision(view.placement(source), {source: view.placement(source)},
                    functools.partial(_localize_shift, dim=dim, shift=shift, fill=None, sequence_pad=None))


@register(causal_conv1d)
def causal_conv1d_rule(node, view):
    """A causal convolution along the sharded sequence (``recognize_causal_convolution``): each rank
    convolves its block with the ``dilation * (k - 1)`` rows before it (``rows_before``), never the
    sequence; the weight and bias whole."""
    args = method_or_function_args(node, ("input", "weight", "bias", "dilation", "groups"))
    source = args["input"]
    value = view.value(source)
    if view.sharded(source) != (value.dim() - 1, 1, 1):
        return None
    reach = args["dilation"] * (view.value(args["weight"]).shape[-1] - 1)
    if reach and not _shift_fits(view, value.shape[-1], reach):
        return None
    demands = {arg: REPLICATE for arg in (args["weight"], args.get("bias")) if isinstance(arg, fx.Node)}
    localize = functools.partial(_localize_causal_convolution, reach=reach) if reach else None
    return Decision(view.placement(source), {source: view.placement(source), **demands}, localize)


@contiguous_blocks_only("a causal convolution along the sequence, rows taken from the block before")
def _localize_causal_convolution(node: fx.Node, sharding, ctx, *, reach: int) -> None:
    source = node.args[0]
    before = insert_call(node.graph, rows_before, (source, sharding.output.dim, reach, ctx.rank_for(node.graph),
                                                   ctx.world_size, ctx.group_name), before=node)
    node.kwargs = {**node.kwargs, "before": before}


def _shift_by_cat(view, first, second, dim: int) -> Decision | None:
    """``torch.cat([head, x[:, :-k]], dim=seq)``: x shifted by k tokens with a whole head of k rows in
    front (a learned start token, zeros), or ``torch.cat([x[:, k:], tail], dim=seq)``: shifted back by k
    with a whole tail of k rows at the end (next-token targets and their padding); as ``shift_seq`` with
    the head entering at the start, or the tail at the end. The slice read only here is not computed."""
    forward = view.sharded(first) is None
    fill, body = (first, second) if forward else (second, first)
    if view.sharded(fill) is not None or view.sharded(body) is None or body.target is not operator.getitem \
            or len(body.users) != 1 or not isinstance(body.args[0], fx.Node):
        return None
    source, entries = body.args[0], index_entries(body.args[1], view.value(body.args[0]).dim())
    factors, length = view.sharded(source), view.value(source).shape[dim]
    shift = view.value(fill).shape[dim] if dim < view.value(fill).dim() else None
    if factors is None or factors[1:] != (1, 1) or factors[0] != dim or len(entries) != view.value(source).dim() \
            or not isinstance(shift, int) or not _shift_fits(view, length, shift) \
            or any(entry != slice(None) for at, entry in enumerate(entries) if at != dim):
        return None
    kept = (slice(None, -shift), slice(0, -shift), slice(None, length - shift), slice(0, length - shift)) if forward \
        else (slice(shift, None), slice(shift, length), slice(shift - length, None), slice(shift - length, length))
    if entries[dim] not in kept:
        return None
    localize = functools.partial(_localize_cat_shift, source=source, head=fill, body=body, dim=dim,
                                 shift=shift if forward else -shift)
    return Decision(view.placement(source), {fill: REPLICATE, body: view.placement(body)}, localize)


@contiguous_blocks_only("a shift along the sequence, rows taken from the neighbouring block")
def _localize_cat_shift(node: fx.Node, sharding, ctx, *, source, head, body, dim, shift) -> None:
    _become(node, _shift_call(node, ctx, source, dim, shift, head), sharding, {source: Shard(dim), head: REPLICATE})
    erase_unused(body)


def _shift_fits(view, length, shift: int) -> bool:
    """Every rank's block holds the |shift| rows it passes on (a static length)."""
    return not is_symbolic(length) and 0 < abs(shift) <= min(block_sizes(length, view.world_size))


@contiguous_blocks_only("a shift along the sequence, rows taken from the neighbouring block")
def _localize_shift(node: fx.Node, sharding, ctx, *, dim, shift, fill, sequence_pad) -> None:
    """The shift as ``shift_seq`` on the rank's block: the node itself becomes the exchange (roll, or a pad of
    the sequence alone), or a pad of other dims too runs on the exchange's result, its sequence entries
    zeroed. Nodes keep their identity: a later rule's rewrite may name them."""
    args, kwargs = list(node.args), dict(node.kwargs)
    source = args[0] if args else kwargs["input"]
    pads = list(args[1] if len(args) > 1 else kwargs["pad"]) if sequence_pad is not None else []
    for at in sequence_pad or ():
        pads[at] = 0
    moved = _shift_call(node, ctx, source, dim, shift, fill)
    if not any(pads):
        _become(node, moved, sharding, {source: Shard(dim)})
        return
    place(moved, NodeSharding(Shard(dim), sharding_of(source).global_value, {source: Shard(dim)}))
    kwargs.update({"input": moved} if not args else {}, **({"pad": tuple(pads)} if len(args) < 2 else {}))
    args[:2] = [moved, tuple(pads)][:len(args)]
    node.args, node.kwargs = tuple(args), kwargs
    place(node, NodeSharding(sharding.output, sharding.global_value, {moved: Shard(dim)}))


def _shift_call(node: fx.Node, ctx, source, dim, shift, fill) -> fx.Node:
    return insert_call(node.graph, shift_seq, (source, dim, shift, fill, ctx.rank_for(node.graph), ctx.world_size,
                                               ctx.group_name),
                       before=node)


def _become(node: fx.Node, call: fx.Node, sharding, inputs: dict) -> None:
    """``node`` turned into ``call`` (which goes), keeping its name, its readers and its output placement."""
    node.op, node.target, node.args, node.kwargs = "call_function", call.target, call.args, call.kwargs  # (x.roll)
    node.meta["custom"] = {**node.meta.get("custom", {}), **call.meta["custom"]}
    node.graph.erase_node(call)
    place(node, NodeSharding(sharding.output, sharding.global_value, inputs))


@register(*spellings("gather"))
def gather_rule(node, view):
    """``torch.gather(x, dim, index)``: each output element reads ``x`` where its index says, so the
    output is sharded like ``index``; ``x`` is read whole along ``dim`` and row-aligned elsewhere (a
    token's own scores at its top-k experts when both are sharded alike)."""
    args = method_or_function_args(node, ("input", "dim", "index"))
    source, dim, index = args["input"], args["dim"], args["index"]
    factors = view.sharded(index)
    x = view.value(source)
    if factors is not None and view.placement(source) == view.placement(index) \
            and normalize_dim(dim, x.dim()) != factors[0] and x.shape[factors[0]] == view.value(index).shape[factors[0]]:
        return Decision(view.placement(index), {index: view.placement(index), source: view.placement(source)})
    if factors is None or view.placement(source) != REPLICATE or factors[1:] != (1, 1):
        return None
    seq_dim = factors[0]
    if normalize_dim(dim, x.dim()) == seq_dim:
        return Decision(view.placement(index), {index: view.placement(index), source: view.placement(source)})
    if x.shape[seq_dim] != view.value(index).shape[seq_dim]:
        return None
    return Decision(view.placement(index), {index: view.placement(index), source: view.placement(index)})
