"""Turn a causal mask the model builds from positions alone into SDPA's ``is_causal=True``.

transformers builds a boolean ``[B, 1, S, S]`` mask even when it is plain causal (its ``sdpa_mask``
from aranges). Left as it is, every rank would build and keep the S x S mask (memory that does not
shrink with P), and SDPA with an explicit mask runs its slower masked kernel.

Before::

    arange = torch.arange(16); ...; le = getitem_6 <= getitem_5; ...      # no graph input involved
    attention_mask = result_2.expand(2, -1, 16, 16)
    attn = scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, scale=0.35)

After (the mask's nodes are dead and removed)::

    attn = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=0.35, is_causal=True)

Only a boolean mask that reads no graph input tensor (no ids, no padding mask, no buffer; a symbolic
size may enter) is considered, and it is rewritten only when it is proven to be the lower triangle at
every index, without computing it. The mask's nodes are read as index algebra (sympy): each tensor is
the expression of its element ``[i0, ..., in-1]``, so ``arange(S)[None, :] <= arange(S)[:, None]`` is
``i1 <= i0``, and an ``[:, None, :, None]`` index or a broadcast only renames indices. Each comparison
in the mask's expression is linear in the indices; over the triangle ``k <= q`` and over its complement
(with the leading indices anywhere in range) it takes one value when it does at the corners of the
region. The mask is causal when its expression is True on the triangle and False off it, and it is not
when a corner, at this call's sizes, says otherwise (a sliding window, ``>=``). The proof holds for every
length, so a symbolic length is served too, and nothing of S x S is built (a model explained on meta
tensors at 128K positions).

A mask this reading cannot decide is computed instead when it is small (2**22 elements, a concrete
shape) and compared with the triangle; otherwise it is kept, and the pass returns a note saying why. A
mask built from an ``attention_mask`` or ``position_ids`` the user passes is kept (its values can change
between calls).

Pinned on a small model: ``tests/test_pass_goldens.py::test_recognize_causal_mask``.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from ulysses_compile.core.compat import is_fake, real_tensors, symbol_hints, symbol_lower_bounds, symbolic_expr
from ulysses_compile.core.errors import UlyssesError
from ulysses_compile.core.fx_graph import erase_unused, fill_example_values
from ulysses_compile.core.random_draws import random_draw
from ulysses_compile.core.report import module_path
from ulysses_compile.core.sizes import is_symbolic, same_size
from ulysses_compile.passes.attention_forms.sdpa import SDPA_PARAMS, SDPA_TARGETS, sdpa_arguments
from ulysses_compile.passes.in_place_writes import alias_bases, written_bases

log = logging.getLogger("ulysses_compile")

MAX_COMPUTED_ELEMENTS = 2**22
INDEX = tuple(sympy.Dummy(f"i{dim}", integer=True, nonnegative=True) for dim in range(16))
BOOLEAN_OR_INTEGER = (torch.bool, torch.int32, torch.int64)


class Undecided(UlyssesError):
    """The mask's nodes could not be read as index algebra, or its expression was not decided."""


class Indexed(NamedTuple):
    """A tensor as the expression of its element ``[i0, ..., in-1]`` (``INDEX[:n]`` and size symbols)."""

    shape: tuple
    expr: sympy.Basic
    boolean: bool


class Verdict(NamedTuple):
    causal: bool
    undecided: str = ""  # why neither the proof nor a computation decided it


def recognize_causal_mask(gm: fx.GraphModule, ctx) -> list[str]:
    verdicts: dict[fx.Node, Verdict] = {}
    notes = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        arguments = sdpa_arguments(node)
        mask = arguments.get("attn_mask")
        if not isinstance(mask, fx.Node) or arguments.get("is_causal", False):
            continue
        where = module_path(node) or node.name
        if mask not in verdicts:
            verdicts[mask] = _verdict(mask, arguments["query"], arguments["key"])
            if verdicts[mask].undecided:
                notes.append(f"{where}: cannot prove the mask causal without computing it: kept "
                             f"({verdicts[mask].undecided})")
        if verdicts[mask].causal:
            _set_argument(node, "attn_mask", None)
            _set_argument(node, "is_causal", True)
            log.info("ulysses_compile: %s: its mask is the causal triangle, built from positions alone; "
                     "it becomes is_causal=True", where)
    for mask, verdict in verdicts.items():
        if verdict.causal:
            erase_unused(mask)
    return notes


def keeps_the_triangle(additive: list[fx.Node], hidden: list[fx.Node], query: fx.Node, key: fx.Node,
                       at: fx.Node) -> bool:
    """Whether scores with the ``additive`` masks added and the positions of ``hidden`` filled with -inf (a
    hand-written attention's, ``handwritten._sdpa_terms``) keep exactly the causal triangle: each additive
    mask a fill, 0 where it keeps a position and -inf or its dtype's lowest value where it hides one
    (transformers' eager masks, ``torch.where(keep, 0, finfo.min)``), and the positions they keep
    together proven the triangle as a boolean mask is. (A row that keeps its diagonal gets probabilities
    of exactly 0 where the lowest value is added, as at -inf.) The nodes made for the proof, before
    ``at``, are erased."""
    graph, made = at.graph, []

    def make(target, *args):
        made.append(graph.call_function(target, args))
        return made[-1]

    try:
        with graph.inserting_before(at):
            keeps = []
            for mask in additive:
                fill = _filled_positions(mask)
                if fill is None:
                    return False
                condition, keeps_condition, views = fill
                if not keeps_condition:
                    condition = make(torch.logical_not, condition)
                for view in reversed(views):
                    made.append(graph.node_copy(view, lambda source, view=view, condition=condition:
                                                condition if source is view.args[0] else source))
                    condition = made[-1]
                keeps.append(condition)
            if hidden:
                keeps.append(make(torch.logical_not, functools.reduce(lambda a, b: make(operator.or_, a, b), hidden)))
            keep = functools.reduce(lambda a, b: make(operator.and_, a, b), keeps)
        fill_example_values(made, at)
        return _verdict(keep, query, key).causal
    finally:
        for node in reversed(made):
            graph.erase_node(node)


_POSITION_VIEWS = (operator.getitem, "expand", torch.unsqueeze, "unsqueeze", "contiguous", "clone")


def _filled_positions(mask: fx.Node) -> tuple[fx.Node, bool, list[fx.Node]] | None:
    """A float mask ``torch.where(condition, 0, lowest)`` (the condition keeps) or ``torch.where(condition,
    lowest, 0)`` (it hides), then views that only move positions: the condition, whether it keeps, the
    views from the mask down; None for any other mask."""
    views, node = [], mask
    while node.op in ("call_function", "call_method") and node.target in _POSITION_VIEWS and node.args \
            and node.all_input_nodes == [node.args[0]]:
        views.append(node)
        node = node.args[0]
    value = _example(node)
    if node.target is not torch.where or len(node.args) != 3 or node.kwargs or not isinstance(value, torch.Tensor) \
            or not value.dtype.is_floating_point:
        return None
    condition, kept, hidden = node.args
    if not (isinstance(condition, fx.Node) and _example(condition).dtype == torch.bool
            and tuple(_example(condition).shape) == tuple(value.shape)):
        return None
    lowest = torch.finfo(value.dtype).min
    if _is_zero(kept) and isinstance(hidden, float) and hidden <= lowest:
        return condition, True, views
    if _is_zero(hidden) and isinstance(kept, float) and kept <= lowest:
        return condition, False, views
    return None


def _is_zero(value) -> bool:
    """A Python zero, or ``torch.zeros(())`` / ``torch.full((), 0)`` made in the graph."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if not isinstance(value, fx.Node) or value.all_input_nodes:
        return False
    if value.target is torch.zeros:
        return True
    return value.target is torch.full and value.kwargs.get("fill_value", value.args[1] if len(value.args) > 1 else None) == 0


def _set_argument(node: fx.Node, name: str, value) -> None:
    index = SDPA_PARAMS.index(name)
    if index < len(node.args):
        node.args = (*node.args[:index], value, *node.args[index + 1 :])
    else:
        node.kwargs = {**node.kwargs, name: value}


def _example(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _verdict(mask: fx.Node, query: fx.Node, key: fx.Node) -> Verdict:
    value = _example(mask)
    queries, keys = (_example(node).shape[-2] for node in (query, key))
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() >= 2
            and same_size(queries, keys) and same_size(value.shape[-2], queries)
            and same_size(value.shape[-1], keys)):
        return Verdict(False)
    nodes = _subgraph(mask)
    if nodes is None:
        return Verdict(False)
    try:
        return Verdict(_prove(nodes, mask))
    except Undecided as undecided:
        computed = _compute(nodes, mask)
        if computed is None:
            return Verdict(False, str(undecided))
        triangle = torch.ones(computed.shape[-2:], dtype=torch.bool, device=computed.device).tril()
        return Verdict(bool((computed == triangle).all()))


def _subgraph(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes the mask is computed from, in graph order, down to sizes; None when a tensor that
    enters the graph (ids, a padding mask, a buffer) is one of them, when one of them is written in
    place (the write is a node of its own, which the mask's inputs do not lead to), or draws random
    numbers."""
    needed, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        if _is_size(_example(node)):
            continue
        if node.op not in ("call_function", "call_method") or random_draw(node) is not None:
            return None
        stack.extend(node.all_input_nodes)
    bases = alias_bases(mask.graph)
    written = written_bases(mask.graph, bases)
    if any(bases.get(node, node) in written for node in needed):
        return None
    return [node for node in mask.graph.nodes if node in needed]


def _is_size(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _compute(nodes: list[fx.Node], mask: fx.Node) -> torch.Tensor | None:
    """The mask's value, when it is small, of a concrete shape and computed from the graph's own nodes
    alone; real values even inside a fake tensor mode (no tensor enters the mask)."""
    included = set(nodes)
    if (any(source not in included for node in nodes for source in node.all_input_nodes)
            or not all(isinstance(size, int) for size in _example(mask).shape)
            or _example(mask).numel() > MAX_COMPUTED_ELEMENTS):
        return None
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        copies[node] = graph.node_copy(node, lambda n: copies[n])
    graph.output(copies[mask])
    with torch.no_grad(), real_tensors():
        computed = fx.GraphModule(torch.nn.Module(), graph)()
    return None if computed.is_meta or is_fake(computed) else computed


def _prove(nodes: list[fx.Node], mask: fx.Node) -> bool:
    """Whether the mask equals ``q >= k`` at every index ``[..., q, k]``, from its nodes read as index
    algebra; raises ``Undecided``."""
    values: dict[fx.Node, Indexed | sympy.Expr] = {}
    handle = None  # a SymInt of the graph: the way to its size symbols' ranges and values
    for node in nodes:
        example = _example(node)
        sizes = [example] if _is_size(example) else list(getattr(example, "shape", ()))
        if handle is None:
            handle = next((size for size in sizes if is_symbolic(size)), None)
        values[node] = _read(node, values)
    mask_value = values[mask]
    rank = len(mask_value.shape)
    expr = sympy.piecewise_fold(mask_value.expr).rewrite(sympy.ITE)
    length = mask_value.shape[-1]
    sizes = sorted(expr.free_symbols.union(*(sympy.sympify(size).free_symbols for size in mask_value.shape))
                   - set(INDEX), key=str)
    if sizes and handle is None:
        raise Undecided(f"the mask depends on {sizes}, which are not sizes of the graph")
    lower = symbol_lower_bounds(handle, sizes) if sizes else {}
    if not all(isinstance(bound, sympy.Integer) for bound in lower.values()):
        raise Undecided(f"a size of the mask has no lower bound: {lower}")
    try:
        hints = symbol_hints(handle, sizes) if sizes else {}
    except KeyError:
        raise Undecided(f"a size of the mask has no value in this call: {sizes}") from None
    shift = {size: lower[size] + sympy.Dummy(str(size), integer=True, nonnegative=True) for size in sizes}
    q, k = INDEX[rank - 2], INDEX[rank - 1]
    leading = _corners(mask_value.shape[: rank - 2])
    # The triangle k <= q and its complement, each the region between its corners [..., q, k]
    regions = [(True, ((0, 0), (length - 1, 0), (length - 1, length - 1)))]
    if not (length.is_number and length < 2):
        regions.append((False, ((0, 1), (0, length - 1), (length - 2, length - 1))))
    at_call = {size: sympy.Integer(hint) for size, hint in hints.items()}
    for expected, ends in regions:
        corners = [dict(zip(INDEX[:rank], map(sympy.sympify, (*corner, *end)))) for corner in leading for end in ends]
        decided = _decide(expr, corners, shift)
        if decided in (sympy.true, sympy.false):
            if bool(decided) != expected:
                return False
            continue
        for corner in corners:  # a counterexample at this call's sizes: not causal
            at = expr.xreplace({index: value.xreplace(at_call) for index, value in corner.items()} | at_call)
            if at in (sympy.true, sympy.false) and bool(at) != expected:
                return False
        raise Undecided(f"{decided} is not decided {'on' if expected else 'off'} the triangle {q} >= {k} of "
                        f"the mask [{', '.join(map(str, INDEX[:rank]))}]")
    return True


def _corners(shape: tuple) -> list[tuple]:
    """The corners of the index box of ``shape``: each index 0 or its size - 1."""
    corners = [()]
    for size in shape:
        ends = (sympy.Integer(0),) if size == 1 else (sympy.Integer(0), sympy.sympify(size) - 1)
        corners = [(*corner, end) for corner in corners for end in ends]
    return corners


def _decide(expr: sympy.Basic, corners: list[dict], shift: dict) -> sympy.Basic:
    """``expr`` with each comparison that takes one value on the region spanned by ``corners`` replaced
    by that value. A comparison ``L >= 0`` (``>``, ``==``, ``!=``) of a linear ``L`` is constant on the
    region when it is at every corner: ``L`` there is a size expression, decided for every size at or
    above its lower bound (``shift`` writes each size as its bound plus a nonnegative integer)."""
    decided = {}
    for atom in expr.atoms(sympy.core.relational.Relational):
        linear = atom.lhs - atom.rhs
        try:
            if sympy.Poly(linear, *INDEX).total_degree() > 1:
                continue
        except sympy.PolynomialError:
            continue
        at_corners = [sympy.expand(linear.xreplace(corner).xreplace(shift)) for corner in corners]
        value = _constant(atom.rel_op, at_corners)
        if value is not None:
            decided[atom] = sympy.true if value else sympy.false
    result = expr.xreplace(decided)
    return result if result in (sympy.true, sympy.false) else sympy.simplify_logic(result)


def _constant(relation: str, values: list) -> bool | None:
    """The value of ``L relation 0`` when it is the same for all ``values`` of ``L`` (and so on the region
    between them), else None."""
    if all(value.is_zero for value in values):
        return relation in ("==", ">=", "<=")
    if all(value.is_positive for value in values):
        return relation in ("!=", ">=", ">")
    if all(value.is_negative for value in values):
        return relation in ("!=", "<=", "<")
    if relation in (">=", "<") and all(value.is_nonnegative for value in values):
        return relation == ">="
    if relation in ("<=", ">") and all(value.is_nonpositive for value in values):
        return relation == "<="
    return None


def _read(node: fx.Node, values: dict) -> Indexed | sympy.Expr:
    example = _example(node)
    if _is_size(example):
        return _size(example)
    if not isinstance(example, torch.Tensor) or example.dtype not in BOOLEAN_OR_INTEGER:
        raise Undecided(f"{node.name} is a {getattr(example, 'dtype', type(example).__name__)}, not a boolean "
                        f"or integer tensor")
    if example.dim() > len(INDEX):
        raise Undecided(f"{node.name} has {example.dim()} dims")
    rule = RULES.get(node.target)
    if rule is None:
        raise Undecided(f"{node.name} = {getattr(node.target, '__name__', node.target)}(...) is not read")
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda source: values[source])
    shape = tuple(_size(size) for size in example.shape)
    boolean = example.dtype == torch.bool
    try:
        expr = rule(shape, boolean, *args, **kwargs)
    except (TypeError, ValueError) as error:
        raise Undecided(f"{node.format_node()}: {error}") from None
    if not expr.free_symbols & set(INDEX) <= set(INDEX[: len(shape)]):
        raise Undecided(f"{node.name}: its expression {expr} has indices beyond its {len(shape)} dims")
    return Indexed(shape, expr, boolean)


def _size(size) -> sympy.Expr:
    return symbolic_expr(size) if is_symbolic(size) else sympy.Integer(size)


def _tensor(value) -> Indexed:
    """An operand: a tensor, or a Python or size scalar as a 0-dim one."""
    if isinstance(value, Indexed):
        return value
    if isinstance(value, bool):
        return Indexed((), sympy.true if value else sympy.false, True)
    if isinstance(value, int):
        return Indexed((), sympy.Integer(value), False)
    if isinstance(value, sympy.Expr) and value.is_integer:
        return Indexed((), value, False)
    raise TypeError(f"operand {value!r} is not a boolean or integer")


def _at(value: Indexed, shape: tuple) -> sympy.Basic:
    """``value``'s element at index ``[i0, ..., in-1]`` of the ``shape`` it broadcasts to."""
    offset = len(shape) - len(value.shape)
    return value.expr.xreplace({INDEX[dim]: sympy.Integer(0) if value.shape[dim] == 1 else INDEX[dim + offset]
                                for dim in range(len(value.shape))})


def _as_int(value: Indexed, shape: tuple) -> sympy.Expr:
    expr = _at(value, shape)
    return sympy.Piecewise((1, expr), (0, True)) if value.boolean else expr


def _as_bool(value: Indexed, shape: tuple) -> sympy.Basic:
    expr = _at(value, shape)
    return expr if value.boolean else sympy.Ne(expr, 0)


def _integer(value) -> sympy.Expr:
    """A Python or size scalar argument (a start, a step, a dim)."""
    if isinstance(value, bool) or not isinstance(value, (int, sympy.Expr)) or not sympy.sympify(value).is_integer:
        raise TypeError(f"{value!r} is not an integer")
    return sympy.Integer(value) if isinstance(value, int) else value


def _arange(shape, boolean, *bounds, **options):
    if boolean:
        raise TypeError("a boolean arange")
    named = dict(zip(("start", "end", "step") if len(bounds) > 1 else ("end",), bounds))
    named.update({name: options[name] for name in ("start", "end", "step") if name in options})
    return _integer(named.get("start", 0)) + _integer(named.get("step", 1)) * INDEX[0]


def _arithmetic(combine):
    def rule(shape, boolean, a, b):
        if boolean:
            raise TypeError("arithmetic on booleans")
        return combine(_as_int(_tensor(a), shape), _as_int(_tensor(b), shape))

    return rule


def _compare(relation):
    def rule(shape, boolean, a, b):
        return relation(_as_int(_tensor(a), shape), _as_int(_tensor(b), shape))

    return rule


def _equal(negate: bool):
    def rule(shape, boolean, a, b):
        a, b = _tensor(a), _tensor(b)
        if a.boolean and b.boolean:
            same = sympy.Equivalent(_at(a, shape), _at(b, shape))
        else:
            same = sympy.Eq(_as_int(a, shape), _as_int(b, shape))
        return sympy.Not(same) if negate else same

    return rule


def _logical(combine, strict: bool):
    """``&``/``|`` (``strict``: booleans only, on integers they are bitwise) and ``logical_and``/``_or``."""
    def rule(shape, boolean, a, b):
        a, b = _tensor(a), _tensor(b)
        if strict and not (a.boolean and b.boolean):
            raise TypeError("a bitwise operation on integers")
        return combine(_as_bool(a, shape), _as_bool(b, shape))

    return rule


def _not(strict: bool):
    def rule(shape, boolean, a):
        a = _tensor(a)
        if strict and not a.boolean:
            raise TypeError("a bitwise not on integers")
        return sympy.Not(_as_bool(a, shape))

    return rule


def _negate(shape, boolean, a):
    if boolean:
        raise TypeError("negating a boolean")
    return -_as_int(_tensor(a), shape)


def _cast(shape, boolean, a, *_, **__):
    """``to``, ``bool()``, ``long()``, ``type_as`` and copies: the dtype is the node's own."""
    return _as_bool(_tensor(a), shape) if boolean else _as_int(_tensor(a), shape)


def _constant_of(fill):
    def rule(shape, boolean, *args, **options):
        value = fill(args, options)
        if isinstance(value, float) or not isinstance(value, (bool, int)):
            raise TypeError(f"a fill value {value!r}")
        return sympy.true if boolean and value else sympy.false if boolean else sympy.Integer(value)

    return rule


def _unsqueeze(shape, boolean, a, dim):
    rank = len(a.shape) + 1
    dim = int(_integer(dim)) % rank
    return a.expr.xreplace({INDEX[d]: INDEX[d + (d >= dim)] for d in range(len(a.shape))})


def _expand(shape, boolean, a, *sizes):
    return _at(a, shape)


def _getitem(shape, boolean, a, index):
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(item, Indexed) for item in index):
        return _index_by_tensors(shape, a, index)
    consumed = sum(item is not None and item is not Ellipsis for item in index)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = (*index[:at], *(slice(None),) * (len(a.shape) - consumed), *index[at + 1 :])
    renamed, dim, out = {}, 0, 0
    for item in index:
        if item is None:
            out += 1
            continue
        size = a.shape[dim]
        if isinstance(item, slice):
            step = _integer(1 if item.step is None else item.step)
            start = _integer(0 if item.start is None else item.start)
            if not (step.is_positive and start.is_nonnegative):
                raise TypeError(f"the slice {item}")
            renamed[INDEX[dim]] = start + step * INDEX[out]
            out += 1
        else:
            position = _integer(item)
            renamed[INDEX[dim]] = position + size if position.is_negative else position
        dim += 1
    for rest in range(dim, len(a.shape)):
        renamed[INDEX[rest]] = INDEX[out]
        out += 1
    if out != len(shape):
        raise TypeError(f"the index {index} of a {len(a.shape)}-dim tensor")
    return a.expr.xreplace(renamed)


def _index_by_tensors(shape, a, index):
    """``a[t0, t1, ...]`` with integer tensors on the leading dims, each in range: element
    ``[j..., rest...]`` is ``a[t0[j...], t1[j...], ..., rest...]``."""
    if not all(isinstance(item, Indexed) and not item.boolean for item in index) or len(index) > len(a.shape):
        raise TypeError("an index other than integer tensors on the leading dims")
    rest = len(a.shape) - len(index)
    indexed = shape[: len(shape) - rest]
    renamed = {}
    for dim, item in enumerate(index):
        position = _at(item, indexed)
        corners = [dict(zip(INDEX, corner)) for corner in _corners(indexed)]
        if _decide(sympy.And(sympy.Ge(position, 0), sympy.Le(position, a.shape[dim] - 1)), corners, {}) != sympy.true:
            raise TypeError(f"the index {position} may leave [0, {a.shape[dim]})")
        renamed[INDEX[dim]] = position
    for dim in range(rest):
        renamed[INDEX[len(index) + dim]] = INDEX[len(indexed) + dim]
    return a.expr.xreplace(renamed)


def _diff(shape, boolean, a, n=1, dim=-1, prepend=None, append=None):
    """``torch.diff`` once along ``dim``, with an optional ``prepend`` of one position."""
    if n != 1 or append is not None or a.boolean:
        raise TypeError("diff other than once, of integers, without append")
    dim = int(_integer(dim)) % len(a.shape)
    position = INDEX[dim]
    later = a.expr - a.expr.xreplace({position: position - 1})
    if prepend is None:
        return later.xreplace({position: position + 1})
    prepend = _tensor(prepend)
    if prepend.shape and (len(prepend.shape) != len(a.shape) or prepend.shape[dim] != 1):
        raise TypeError("a prepend of more than one position")
    first = a.expr.xreplace({position: 0}) - _as_int(prepend, a.shape).xreplace({position: 0})
    return sympy.Piecewise((later, position > 0), (first, True))


def _cumsum(shape, boolean, a, dim, **options):
    """A cumulative sum of a tensor constant along ``dim``: the constant times the count."""
    dim = int(_integer(dim)) % len(a.shape)
    term = _as_int(a, a.shape)
    if boolean or INDEX[dim] in term.free_symbols:
        raise TypeError("a cumsum of values that change along its dim")
    return term * (INDEX[dim] + 1)


def _triangle(keep):
    def rule(shape, boolean, a, diagonal=0):
        row, column = INDEX[len(shape) - 2], INDEX[len(shape) - 1]
        inside = keep(column - row, _integer(diagonal))
        return sympy.And(a.expr, inside) if boolean else sympy.Piecewise((_as_int(a, shape), inside), (0, True))

    return rule


_BINARY = {
    **{target: _arithmetic(operator.add) for target in (operator.add, torch.add, "add")},
    **{target: _arithmetic(operator.sub) for target in (operator.sub, torch.sub, "sub")},
    **{target: _compare(sympy.Lt) for target in (operator.lt, torch.lt, "lt")},
    **{target: _compare(sympy.Le) for target in (operator.le, torch.le, "le")},
    **{target: _compare(sympy.Gt) for target in (operator.gt, torch.gt, "gt")},
    **{target: _compare(sympy.Ge) for target in (operator.ge, torch.ge, "ge")},
    **{target: _equal(False) for target in (operator.eq, torch.eq, "eq")},
    **{target: _equal(True) for target in (operator.ne, torch.ne, "ne")},
    **{target: _logical(sympy.And, True) for target in (operator.and_, torch.bitwise_and, "bitwise_and")},
    **{target: _logical(sympy.Or, True) for target in (operator.or_, torch.bitwise_or, "bitwise_or")},
    **{target: _logical(sympy.And, False) for target in (torch.logical_and, "logical_and")},
    **{target: _logical(sympy.Or, False) for target in (torch.logical_or, "logical_or")},
}

# How each op the mask builders use maps element expressions; a rule gets the node's shape and whether
# it is boolean, then the node's arguments (tensors as ``Indexed``, sizes as sympy expressions).
RULES = {
    **_BINARY,
    **{target: _not(True) for target in (operator.invert, torch.bitwise_not, "bitwise_not")},
    **{target: _not(False) for target in (torch.logical_not, "logical_not")},
    **{target: _negate for target in (operator.neg, torch.neg, "neg")},
    torch.arange: _arange,
    **{target: _unsqueeze for target in (torch.unsqueeze, "unsqueeze")},
    "expand": _expand,
    operator.getitem: _getitem,
    **{target: _cast for target in ("to", "bool", "long", "int", "type_as", "contiguous", "clone", "detach")},
    **{target: _diff for target in (torch.diff, "diff")},
    **{target: _cumsum for target in (torch.cumsum, "cumsum")},
    **{target: _triangle(sympy.Le) for target in (torch.tril, "tril")},
    **{target: _triangle(sympy.Ge) for target in (torch.triu, "triu")},
    **{target: _constant_of(lambda args, options: 1) for target in (torch.ones, "new_ones")},
    **{target: _constant_of(lambda args, options: 0) for target in (torch.zeros, "new_zeros")},
    torch.full: _constant_of(lambda args, options: options.get("fill_value", args[1] if len(args) > 1 else None)),
    "new_full": _constant_of(lambda args, options: options.get("fill_value", args[2] if len(args) > 2 else None)),
}
