"""Mixture-of-experts routing on a rank's own tokens.

Routing is token-local: a token's router scores, top-k experts and weights, and its expert outputs
depend on that token alone. Selections along the expert dim (top-k, sort, one-hot, gather, scatter)
therefore keep the sequence sharding.

Dispatch sorts the (token, slot) pairs by expert, runs each expert on its contiguous rows (a grouped
matmul with per-expert offsets) and puts the rows back. A rank sorts its own rows: the result is
``PermutedShard(order=the sort)``, its rows in an order no other rank shares, and the sort's indices are
``Positions``: this rank's positions into its block. Only the rules registered here with
``permuted=True`` read such values, and the rows leave that order only where they are put back in
token order: indexed by the inverse permutation (``inv[perm] = arange(n)``), or added into a token
buffer at their positions (``index_add_``). Per-expert counts of the sorted rows (``histc``) are the
rank's own counts, ``Partial(over=the sort)``: a grouped matmul over the same rows reads them as they
are; any other reader completes them (the global counts). Anything else that reads the permuted rows
strands them, and propagation then gathers the sort's input instead (``propagate_sharding``).

    ids = topk(probs, k).indices.reshape(-1)        # S(0|1x.xk)    token-local
    ids_g, perm = sort(ids)                          # S~sort, I[S~sort->S(0|1x.xk)]
    rows = h[perm // k]                              # S~sort        h: S(0)
    counts = histc(ids_g.float(), E, 0, E - 1)       # P(sort)
    out = grouped_mm(rows, w, offs=cumsum(counts))   # S~sort
    inv = empty_like(perm); inv[perm] = arange(n)    # I[S(0|1x.xk)->S~sort]  (arange: this rank's n)
    back = out[inv]                                  # S(0|1x.xk)   in token order again
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.core.fx_graph import descendants
from ulysses_compile.core.fx_graph import index_entries, insert_part, method_or_function_args, normalize_dim
from ulysses_compile.core.ops import CASTS, elementwise, spellings
from ulysses_compile.core.sharding import (
    PARTIAL,
    REPLICATE,
    NodeSharding,
    Partial,
    PermutedShard,
    Positions,
    Shard,
    completed,
    local_shape,
    place,
    seq_factors,
    seq_shard,
    sharding_of,
    with_dim,
)
from ulysses_compile.core.sizes import same_size, size_arg
from ulysses_compile.passes.rules import Decision, register
from ulysses_compile.passes.rules.pointwise import CAST_LIKE, cast_like
from ulysses_compile.passes.rules.reductions import SUM_PARAMS, _keepdim, _reduced_dims
from ulysses_compile.passes.rules.shape_ops import (
    SPLITS,
    TRANSPOSES,
    UNBINDS,
    VIEWS,
    _global_size,
    _indexed,
    _localize_shape,
    _permute,
    _squeeze,
    _transpose,
    _unsqueeze,
    view_placement,
)

SELECTIONS = spellings("topk", "sort", "argsort")
_SELECTION_PARAMS = {"topk": ("input", "k", "dim"), "sort": ("input", "dim"), "argsort": ("input", "dim")}


def _first(node: fx.Node):
    return node.args[0] if node.args else node.kwargs.get("input")


def _selection_dim(node, value) -> int:
    name = node.target if isinstance(node.target, str) else node.target.__name__
    return normalize_dim(method_or_function_args(node, _SELECTION_PARAMS[name], {"dim": -1})["dim"], value.dim())


@register(*SELECTIONS)
def selection_rule(node, view):
    """Top-k, sort and argsort along a dim other than the sequence: each token's own selection. A sort
    of a 1-D sequence-sharded tensor along it sorts the rank's rows (see the module docstring)."""
    source = _first(node)
    factors = view.sharded(source)
    value = view.value(source)
    if factors is None:
        return None
    placement = view.placement(source)
    outputs = view.value(node)
    if _selection_dim(node, value) != factors[0]:
        return Decision(tuple(placement for _ in outputs) if isinstance(outputs, tuple) else placement,
                        {source: placement})
    if value.dim() != 1 or node.target in ("topk", torch.topk):
        return None
    rows = PermutedShard(0, factors[1], factors[2], node.name)
    positions = Positions(rows, placement)
    return Decision((rows, positions) if isinstance(outputs, tuple) else positions, {source: placement})


@register(*spellings("one_hot"))
def one_hot_rule(node, view):
    source = node.args[0] if node.args else node.kwargs["tensor"]
    if view.sharded(source) is None:
        return None
    return Decision(view.placement(source), {source: view.placement(source)})


HISTC_PARAMS = ("input", "bins", "min", "max")


def _fixed_range(node) -> bool:
    """``histc`` with its range given: the default (0, 0) takes each rank's own min and max instead."""
    args = method_or_function_args(node, HISTC_PARAMS, {"min": 0, "max": 0})
    return isinstance(args["min"], (int, float)) and isinstance(args["max"], (int, float)) and args["min"] < args["max"]


@register(*spellings("histc"))
def count_rule(node, view):
    """Counts over the rank's elements in a fixed range: their sum over ranks is the global count."""
    source = method_or_function_args(node, HISTC_PARAMS)["input"]
    if view.sharded(source) is None or not _fixed_range(node):
        return None
    return Decision(PARTIAL, {source: view.placement(source)})


SCATTERS = spellings("scatter", "scatter_add", "scatter_reduce", in_place=True)


@register(*SCATTERS)
def scatter_rule(node, view):
    """``x.scatter_(d, index, src)`` along a dim other than the sequence: each token writes its own row
    (DeepSeek-V3's group mask)."""
    args = method_or_function_args(node, ("input", "dim", "index", "src"))
    target, index = args["input"], args["index"]
    factors = view.sharded(target)
    if factors is None or normalize_dim(args["dim"], view.value(target).dim()) == factors[0]:
        return None
    placement = view.placement(target)
    demands = {target: placement, index: placement}
    source = args.get("src", args.get("value"))
    if isinstance(source, fx.Node) and view.is_tensor(source):
        demands[source] = placement
    if any(view.value(arg).shape[factors[0]] != view.value(target).shape[factors[0]] for arg in demands):
        return None
    return Decision(placement, demands)


LIKE = spellings("empty_like", "zeros_like", "ones_like", "full_like")
FRESH_BUFFERS = frozenset({*LIKE, *spellings("new_empty", "new_zeros", "new_ones", "new_full")})


@register(*LIKE)
def like_rule(node, view):
    """A new tensor shaped like a sharded one: each rank makes its block. Its values are not read; a
    later write that cannot stay sharded makes propagation keep it whole (``propagate_sharding``)."""
    source = _first(node)
    if view.sharded(source) is None:
        return None
    return Decision(view.placement(source), {source: view.placement(source)})


def whole_like(node: fx.Node, view) -> NodeSharding | None:
    """A new tensor shaped like a sharded one, made whole (a write into it cannot stay sharded, as
    ``empty_like(h).uniform_()`` for router jitter): made at its global shape with ``x.new_*``, which
    reads only x's dtype and device, so x is not gathered for it."""
    source = _first(node)
    placement = view.actual_placement(source) if isinstance(source, fx.Node) else None
    if node.target not in LIKE or seq_factors(completed(placement) if placement else None) is None:
        return None
    return NodeSharding(REPLICATE, view.value(node), {source: placement}, _localize_whole_like)


def _localize_whole_like(node: fx.Node, sharding, ctx) -> None:
    name = node.target if isinstance(node.target, str) else node.target.__name__
    kind = name.removesuffix("_like")
    source = _first(node)
    fill = node.args[1:2] if kind == "full" else ()
    kwargs = {key: value for key, value in node.kwargs.items() if key not in ("input", "memory_format")}
    fill = (kwargs.pop("fill_value"),) if "fill_value" in kwargs else fill
    shape = size_arg(node.graph, tuple(sharding.global_value.shape), before=node)
    node.op, node.target = "call_method", f"new_{kind}"
    node.args, node.kwargs = (source, tuple(shape), *fill), kwargs


# Rules for the permuted rows.


def _permuted_like(view, node, args) -> Decision | None:
    """Elementwise on rows of one order: every permuted input in that order along the same output dim,
    every other input replicated and broadcast along it."""
    out = view.value(node)
    if not isinstance(out, torch.Tensor):
        return None
    targets = set()
    for arg in args:
        placement = view.placement(arg)
        if isinstance(placement, PermutedShard):
            value = view.value(arg)
            out_dim = placement.dim + out.dim() - value.dim()
            if value.shape[placement.dim] != out.shape[out_dim]:
                return None
            targets.add(with_dim(placement, out_dim))
        elif placement is not None and placement != REPLICATE:
            return None
    if len(targets) != 1:
        return None
    target = targets.pop()
    demands = {}
    for arg in args:
        placement = view.placement(arg)
        if isinstance(placement, PermutedShard):
            demands[arg] = placement
            continue
        dim = target.dim - (out.dim() - view.value(arg).dim())
        if dim >= 0 and not same_size(view.value(arg).shape[dim], 1):
            return None
        demands[arg] = REPLICATE
    return Decision(target, demands)


@register(*(target for target in elementwise() if target not in CAST_LIKE), *LIKE, permuted=True)
def permuted_pointwise_rule(node, view):
    if node.target in spellings("floor_divide") or node.target in spellings("div", "divide") \
            and node.kwargs.get("rounding_mode") in ("floor", "trunc"):
        return _positions_divided(node, view)
    if node.target in LIKE:
        return _like_permuted(node, view)
    return _permuted_like(view, node, view.tensor_args(node))


@register(*CAST_LIKE, permuted=True)
def permuted_cast_like_rule(node, view):
    """``x.type_as(y)`` / ``x.to(y)`` with rows in a rank's order on either side: only y's dtype and
    device are read, so x keeps its placement and y stays where it is."""
    return cast_like(node, view, permuted_pointwise_rule)


def _positions_divided(node, view) -> Decision | None:
    """``perm // k``: positions into ``[.., S, k]`` merged rows become positions into ``[.., S]``."""
    positions, divisor = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    placement = view.placement(positions)
    factors = seq_factors(placement.into) if isinstance(placement, Positions) else None
    if factors is None or not isinstance(divisor, int) or divisor <= 0 or factors[2] % divisor:
        return None
    into = seq_shard(factors[0], factors[1], factors[2] // divisor)
    return Decision(Positions(placement.rows, into), {positions: placement})


def _like_permuted(node, view) -> Decision | None:
    """A new tensor shaped like permuted rows or positions. Shaped like a sort's indices, it is taken to be
    the inverse permutation about to be written (``inv[perm] = arange(n)``): laid out in token order, its
    values positions into the sorted rows; any other write into it strands the sort."""
    source = _first(node)
    placement = view.placement(source)
    if isinstance(placement, PermutedShard):
        return Decision(placement, {source: placement})
    rows = placement.rows if isinstance(placement, Positions) else None
    if isinstance(rows, PermutedShard) and placement.into == seq_shard(rows.dim, rows.outer, rows.inner) \
            and node.target in ("empty_like", torch.empty_like):
        return Decision(Positions(placement.into, placement.rows), {source: placement})
    return None


@register(operator.setitem, permuted=True)
def inverse_permutation_rule(node, view):
    """``inv[perm] = arange(n)`` into ``inv = empty_like(perm)``: the inverse of this rank's sort. The
    arange counts this rank's rows."""
    target, index, value = node.args
    have, positions = view.placement(target), view.placement(index)
    if not (isinstance(positions, Positions) and isinstance(positions.rows, PermutedShard)
            and have == Positions(positions.into, positions.rows) and _is_arange_over(value, view.value(index))):
        return None
    return Decision(have, {target: have, index: positions, value: REPLICATE}, _localize_arange)


def _is_arange_over(value, indices) -> bool:
    if not isinstance(value, fx.Node) or value.target is not torch.arange or value.kwargs.get("dtype") not in (None, indices.dtype):
        return False
    bounds = value.args if len(value.args) != 1 else (0, value.args[0])
    return len(bounds) == 2 and bounds[0] == 0 and value.meta["example_value"].shape == indices.shape


def _localize_arange(node: fx.Node, sharding, ctx) -> None:
    target, index, value = node.args
    (count,) = local_shape(sharding_of(index).global_value.shape, sharding.inputs[index], ctx.world_size, ctx.rank)
    local = insert_part(node, "call_function", torch.arange, (size_arg(node.graph, count, before=node),), value.kwargs)
    place(local, NodeSharding(REPLICATE, None))
    node.args = (target, index, local)


@register(operator.getitem, permuted=True)
def permuted_getitem_rule(node, view):
    """A tuple's part, or rows gathered at positions: ``h[perm // k]`` (into ``h``'s token rows: the
    rows in the sort's order), ``out[inv]`` (into the sorted rows: token order again) and
    ``bias[expert_ids]`` (a replicated table read at the rank's rows)."""
    source, index = node.args
    placement = view.placement(source)
    if isinstance(placement, tuple):
        return Decision(placement[index], {})
    entries = index_entries(index, view.value(source).dim()) if not isinstance(index, fx.Node) else [index]
    first, rest = entries[0], entries[1:]
    rows = placement.rows if isinstance(placement, Positions) else placement
    if isinstance(rows, PermutedShard) and not any(isinstance(entry, fx.Node) for entry in entries):
        # Basic indexing that leaves the rows whole (gpt-oss's gate_up[..., ::2], positions[:, 0]).
        as_sharded = _indexed(view.overridden({source: seq_shard(rows.dim)}), source, index)
        if as_sharded is None or as_sharded.localize is not None or not isinstance(as_sharded.output, Shard):
            return None
        moved = with_dim(rows, as_sharded.output.dim)
        return Decision(Positions(moved, placement.into) if rows is not placement else moved, {source: placement})
    if not isinstance(first, fx.Node) or any(entry != slice(None) for entry in rest):
        return None
    positions = view.placement(first)
    if isinstance(positions, Positions) and placement == positions.into:
        return Decision(positions.rows, {source: placement, first: positions})
    if isinstance(positions, PermutedShard) and placement == REPLICATE and view.value(first).dim() == 1:
        return Decision(positions, {source: REPLICATE, first: positions})
    return None


_DIM_MAPS = {**dict.fromkeys(spellings("unsqueeze"), _unsqueeze), **dict.fromkeys(spellings("squeeze"), _squeeze),
             **dict.fromkeys(spellings("permute"), _permute)}


@register(*_DIM_MAPS, *TRANSPOSES, permuted=True)
def permuted_dims_rule(node, view):
    mapping = _DIM_MAPS.get(node.target, _transpose)
    source = _first(node)
    placement = view.placement(source)
    rows = placement.rows if isinstance(placement, Positions) else placement
    if not isinstance(rows, PermutedShard):
        return None
    out_dim = mapping(node, rows.dim, view.value(source), view.value(node))
    if out_dim is None:
        return None
    moved = with_dim(rows, out_dim)
    return Decision(Positions(moved, placement.into) if isinstance(placement, Positions) else moved, {source: placement})


@register("expand", permuted=True)
def permuted_expand_rule(node, view):
    """Sorted positions broadcast along the features (``idx.unsqueeze(-1).expand(-1, H)``) to gather or
    scatter whole rows: the rows dim stays where it is, its size the rank's."""
    source = _first(node)
    placement = view.placement(source)
    rows = placement.rows if isinstance(placement, Positions) else placement
    value, out = view.value(source), view.value(node)
    if not isinstance(rows, PermutedShard) or value.dim() != out.dim() or value.shape[rows.dim] != out.shape[rows.dim]:
        return None
    return Decision(placement, {source: placement}, _localize_shape("expand"))


@register("expand_as", permuted=True)
def permuted_expand_as_rule(node, view):
    """``rows.expand_as(other)``: as ``expand``, ``other`` read only for its shape."""
    other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    decision = permuted_expand_rule(node, view)
    if decision is None or not isinstance(other, fx.Node):
        return None
    return Decision(decision.output, {other: view.actual_placement(other), **decision.inputs}, decision.localize)


@register(*VIEWS, permuted=True)
def permuted_view_rule(node, view):
    """A view that keeps the rows one dim of their own (``idx.reshape(-1, 1)``, as torchtitan writes it)."""
    source = _first(node)
    placement = view.placement(source)
    rows = placement.rows if isinstance(placement, Positions) else placement
    out = view.value(node)
    if not isinstance(rows, PermutedShard) or not isinstance(out, torch.Tensor) or node.target in ("view_as", "reshape_as"):
        return None
    moved = view_placement(tuple(view.value(source).shape), tuple(out.shape), (rows.dim, 1, 1))
    if not isinstance(moved, Shard):
        return None
    moved = with_dim(rows, moved.dim)
    method = "view" if node.target == "view" else "reshape"
    return Decision(Positions(moved, placement.into) if rows is not placement else moved, {source: placement},
                    _localize_shape(method))


@register(*spellings("gather", "index_select"), permuted=True)
def permuted_gather_rule(node, view):
    """``torch.gather(x, 0, positions)`` / ``x.index_select(0, positions)``: rows read at the rank's
    positions, as ``x[positions]``."""
    args = method_or_function_args(node, ("input", "dim", "index"))
    source, index = args["input"], args["index"]
    placement, positions = view.placement(source), view.placement(index)
    if not (isinstance(positions, Positions) and placement == positions.into and seq_factors(placement) is not None
            and seq_factors(placement)[0] == normalize_dim(args["dim"], view.value(source).dim()) == 0
            and positions.rows.dim == 0):
        return None
    return Decision(positions.rows, {source: placement, index: positions})


@register(*SPLITS, *UNBINDS, permuted=True)
def permuted_split_rule(node, view):
    """Splits along a dim other than the rows (a fused gate/up projection's two halves), and splits of
    the rows at per-expert counts (:func:`_counts_per_expert`)."""
    source = _first(node)
    placement = view.placement(source)
    outputs = view.value(node)
    if not isinstance(placement, PermutedShard) or not isinstance(outputs, (tuple, list)):
        return None
    unbind = node.target in UNBINDS
    names = ("input", "dim") if unbind else ("input", "sections", "dim")
    args = method_or_function_args(node, names, {"dim": 0})
    dim = normalize_dim(args["dim"], view.value(source).dim())
    if dim == placement.dim:
        sections = _split_sections(node)
        counts = None if sections is None else _counts_per_expert(sections[1], placement.order, view)
        if counts is None:
            return None
        return Decision(tuple(placement for _ in outputs), {source: placement, counts: PARTIAL},
                        _split_by_local_counts(counts, sections[0]))
    part = with_dim(placement, placement.dim - (1 if unbind and dim < placement.dim else 0))
    return Decision(tuple(part for _ in outputs), {source: placement})


_SIZED_SPLITS = (torch.split, "split")


def _split_sections(node: fx.Node) -> tuple[int | str, object] | None:
    """Where a split by sizes holds its sizes (an argument position or keyword) and what they are;
    None for splits whose list means something else (``tensor_split``'s cut positions) or that have none."""
    if node.target not in _SIZED_SPLITS:
        return None
    if len(node.args) > 1:
        return 1, node.args[1]
    for keyword in ("split_size_or_sections", "split_size"):
        if keyword in node.kwargs:
            return keyword, node.kwargs[keyword]
    return None


def _counts_per_expert(sections, order: str, view) -> fx.Node | None:
    """The ``histc`` whose counts ``sections`` reads one by one (``counts.tolist()`` that Dynamo captured
    with scalar outputs: ``counts[e].item()`` for e = 0, 1, ...), where it counts, per expert in
    ascending order, the very values the sort ``order`` sorts ascending: then the sorted rows split at
    the rank's own counts are its rows of each expert, in turn."""
    if not isinstance(sections, (list, tuple)) or not sections:
        return None
    reads = [_item_of(section) for section in sections]
    if any(read is None for read in reads) or len({counts for counts, _ in reads}) != 1 \
            or [index for _, index in reads] != list(range(len(sections))):
        return None
    histc = _uncast(reads[0][0])
    if histc.op not in ("call_function", "call_method") or histc.target not in ("histc", torch.histc) \
            or not _fixed_range(histc):
        return None
    args = method_or_function_args(histc, HISTC_PARAMS, {"bins": 100})
    if args["bins"] != len(sections) or any(_histc_bin(e, args) != e for e in range(args["bins"])):
        return None
    sort = next((n for n in histc.graph.nodes if n.name == order), None)
    sorted_values = None if sort is None else _sorted_input(sort)
    if sorted_values is None or sorted_values is not _uncast(args["input"]) or view.value(sorted_values).dim() != 1:
        return None
    return histc


def _histc_bin(value: int, args: dict) -> int:
    """The bin ``histc`` counts an integer in (its maximum in the last bin)."""
    bins, low, high = args["bins"], args["min"], args["max"]
    return bins - 1 if value == high else int((value - low) * bins / (high - low))


def _item_of(section) -> tuple[fx.Node, int] | None:
    if not (isinstance(section, fx.Node) and section.op == "call_method" and section.target == "item"):
        return None
    element = section.args[0]
    if element.target is not operator.getitem or not isinstance(element.args[1], int):
        return None
    return element.args[0], element.args[1]


def _uncast(node: fx.Node) -> fx.Node:
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in CASTS:
        node = node.args[0]
    return node


def _sorted_input(sort: fx.Node) -> fx.Node | None:
    """What an ascending ``argsort`` (or ``sort``'s indices) sorts, through casts."""
    if sort.target is operator.getitem and sort.args[1] == 1:
        sort = sort.args[0]
    if sort.target not in ("argsort", torch.argsort, "sort", torch.sort) or \
            method_or_function_args(sort, ("input", "dim", "descending"), {"descending": False})["descending"]:
        return None
    return _uncast(_first(sort))


def _split_by_local_counts(counts: fx.Node, where: int | str):
    """Split the rank's sorted rows at its own counts, read from the rank's term of the counts; the
    global counts' reads go, with Dynamo's checks of them, where nothing else reads them."""

    def localize(node: fx.Node, sharding, ctx) -> None:
        graph = node.graph
        global_reads = node.args[where] if isinstance(where, int) else node.kwargs[where]
        with graph.inserting_before(node):
            local = place(graph.call_method("long", (counts,)), NodeSharding(PARTIAL, None, {counts: PARTIAL}))
            sections = place(graph.call_method("tolist", (local,)), NodeSharding(None, None, {local: PARTIAL}))
        if isinstance(where, int):
            node.args = (*node.args[:where], sections, *node.args[where + 1:])
        else:
            node.kwargs = {**node.kwargs, where: sections}
        _drop_unread(global_reads)

    return localize


def _drop_unread(reads) -> None:
    """The global counts' reads where nothing but Dynamo's checks of them reads them (each count within
    the rows, their sum the rows): the rank's split checks its own sizes."""
    erased: set[fx.Node] = set()
    pending = list(reads)
    while pending:
        node = pending.pop()
        if node in erased or not _is_read(node):
            continue
        readers = descendants([node]) - {node}
        if not all(_is_check(reader) for reader in readers) or any(
                not reader.users and reader.target not in _ASSERTIONS for reader in readers):
            continue
        inputs = node.all_input_nodes
        for reader in [candidate for candidate in reversed(node.graph.nodes) if candidate in readers]:
            if reader not in erased:
                erased.add(reader)
                reader.graph.erase_node(reader)
        erased.add(node)
        node.graph.erase_node(node)
        pending += [arg for arg in inputs if arg not in erased]


def _is_read(node: fx.Node) -> bool:
    """A count read out of the counts tensor: ``.item()``, an element, a cast."""
    return node.op == "call_method" and node.target in ("item", *CASTS) or node.target is operator.getitem


_ASSERTIONS = (torch.ops.aten._assert_scalar.default, torch._check, torch._check_is_size)


def _is_check(node: fx.Node) -> bool:
    """A symbolic comparison or sum Dynamo adds for a size read from data, or its runtime assertion."""
    return node.op == "call_function" and node.target in (*_ASSERTIONS, torch.sym_sum, operator.eq, operator.ge,
                                                          operator.le, operator.add)


@register(*spellings("cat", "concat", "concatenate"), permuted=True)
def permuted_cat_rule(node, view):
    """The pieces of split sorted rows, each through its expert, joined again in the order they were
    split (piece e has the e-th count's rows): the rows in their sort's order."""
    args = method_or_function_args(node, ("tensors", "dim"), {"dim": 0})
    pieces = args["tensors"]
    if not isinstance(pieces, (list, tuple)) or not pieces:
        return None
    placements = {view.placement(piece) for piece in pieces}
    if len(placements) != 1:
        return None
    placement = placements.pop()
    dim = normalize_dim(args["dim"], view.value(pieces[0]).dim())
    if not (isinstance(placement, PermutedShard) and dim == placement.dim and _split_pieces_in_order(pieces)):
        return None
    return Decision(placement, {piece: placement for piece in pieces})


def _split_pieces_in_order(pieces) -> bool:
    """Whether piece e comes, through ops on its rows (each piece's first input), from the e-th part of
    one split of sorted rows, and every part is there."""
    sources = [_split_part(piece) for piece in pieces]
    if any(source is None for source in sources) or len({split for split, _ in sources}) != 1:
        return False
    split = sources[0][0]
    return [index for _, index in sources] == list(range(len(split.meta["example_value"])))


def _split_part(node: fx.Node) -> tuple[fx.Node, int] | None:
    while isinstance(node, fx.Node) and isinstance(_output_of(node), PermutedShard):
        if node.target is operator.getitem and isinstance(_output_of(node.args[0]), tuple):
            return node.args[0], node.args[1]
        node = node.args[0] if node.args else None
    return None


def _output_of(node) -> object:
    sharding = sharding_of(node) if isinstance(node, fx.Node) else None
    return sharding.output if sharding is not None else None


@register(*spellings("histc"), permuted=True)
def permuted_count_rule(node, view):
    """Per-expert counts of the sorted expert ids: the rank's own counts, what its grouped matmul needs."""
    source = method_or_function_args(node, HISTC_PARAMS)["input"]
    placement = view.placement(source)
    if not isinstance(placement, PermutedShard) or not _fixed_range(node) or not _is_sorted_values(source, placement.order):
        return None
    return Decision(Partial(over=placement.order), {source: placement})



def _is_sorted_values(node: fx.Node, order: str) -> bool:
    """Whether ``node`` is the values output of the sort ``order`` (through casts): what grouped offsets
    count, so that the counts describe the rows in that order."""
    node = _uncast(node)
    return node.target is operator.getitem and node.args[1] == 0 and node.args[0].name == order


@register(*spellings("cumsum"), permuted=True)
def permuted_cumsum_rule(node, view):
    """Offsets from counts: a cumulative sum along the experts is still the rank's own."""
    source = _first(node)
    placement = view.placement(source)
    if not (isinstance(placement, Partial) and placement.over):
        return None
    return Decision(placement, {source: placement})


@register("transformers::grouped_mm_fallback", torch._grouped_mm, F.grouped_mm, permuted=True)
def grouped_mm_rule(node, view):
    """``grouped_mm(rows, weight, offs)``: row block e (``offs[e-1]:offs[e]``) times ``weight[e]``. On a
    rank's sorted rows with its own counts, every row meets its expert."""
    if len(node.args) < 2:
        return None
    rows, weight = node.args[:2]
    offsets = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    placement = view.placement(rows)
    if not (isinstance(placement, PermutedShard) and placement.dim == 0 and view.value(rows).dim() == 2
            and view.value(weight).dim() == 3 and view.placement(weight) == REPLICATE
            and isinstance(offsets, fx.Node) and view.placement(offsets) == Partial(over=placement.order)):
        return None
    return Decision(placement, {rows: placement, weight: REPLICATE, offsets: view.placement(offsets)})


@register(*spellings("bmm", "matmul"), permuted=True)
def permuted_bmm_rule(node, view):
    """Row-batched matmuls of rows in one order (each row with its expert's weight)."""
    a, b = node.args[:2]
    pa, pb = view.placement(a), view.placement(b)
    if isinstance(pa, PermutedShard) and pa == pb and pa.dim == 0 and view.value(a).dim() == view.value(b).dim() == 3:
        return Decision(pa, {a: pa, b: pb})
    if isinstance(pa, PermutedShard) and pb == REPLICATE and view.value(b).dim() <= 2 \
            and pa.dim < view.value(a).dim() - 1:
        return Decision(pa, {a: pa, b: REPLICATE})
    return None


@register(*spellings("linear"), permuted=True)
def permuted_linear_rule(node, view):
    args = method_or_function_args(node, ("input", "weight", "bias"))
    x = args["input"]
    placement = view.placement(x)
    if not isinstance(placement, PermutedShard) or placement.dim == view.value(x).dim() - 1:
        return None
    demands = {x: placement, args["weight"]: REPLICATE}
    if isinstance(args.get("bias"), fx.Node):
        demands[args["bias"]] = REPLICATE
    return Decision(placement, demands)


@register(*spellings("sum"), permuted=True)
def permuted_sum_rule(node, view):
    """A sum over the permuted rows is the rank's part of the sum over its tokens; over other dims the
    rows stay."""
    source = _first(node)
    placement = view.placement(source)
    if not isinstance(placement, PermutedShard):
        return None
    dims = _reduced_dims(node, view.value(source), SUM_PARAMS)
    if placement.dim in dims:
        return Decision(PARTIAL, {source: placement})
    kept = placement.dim - (0 if _keepdim(node, SUM_PARAMS) else sum(d < placement.dim for d in dims))
    return Decision(with_dim(placement, kept), {source: placement})


@register(*spellings("index_add", "index_copy", "scatter_add", in_place=True), permuted=True)
def put_back_rule(node, view):
    """``tokens.index_add_(0, positions, rows)`` (or ``scatter_add_`` with the positions broadcast along
    the features): the sorted rows added back at their tokens' positions."""
    args = method_or_function_args(node, ("input", "dim", "index", "source"))
    target, index, rows = args["input"], args["index"], args.get("source", args.get("src"))
    have, positions = view.placement(target), view.placement(index)
    if not (isinstance(positions, Positions) and have == positions.into and seq_factors(have) is not None
            and seq_factors(have)[0] == normalize_dim(args["dim"], view.value(target).dim()) == 0
            and positions.rows.dim == 0 and view.placement(rows) == positions.rows):
        return None
    return Decision(have, {target: have, index: positions, rows: positions.rows})


@register("size", permuted=True)
def permuted_size_rule(node, view):
    """The program asked for the global size, as of a sequence-sharded value."""
    source = _first(node)
    return Decision(None, {source: view.placement(source)}, _global_size)
