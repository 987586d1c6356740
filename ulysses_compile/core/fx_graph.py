"""What the passes read off an FX graph and change in it: walks over inputs and users, a node's
arguments bound to parameter names, the argument an op writes into, nodes inserted beside a node and
unused ones erased."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from ulysses_compile.core.compat import FakeTensor, copy_recompute_tag
from ulysses_compile.core.ops import in_place_operators


def ancestors(nodes) -> set[fx.Node]:
    """``nodes`` and every node they are computed from, graph inputs included."""
    return _closure(nodes, lambda node: node.all_input_nodes)


def value_ancestors(nodes) -> set[fx.Node]:
    """``nodes`` and every node whose values they are computed from: not through a size read off a
    tensor (``x.shape[2]`` in a graph compiled for every length is a node reading ``x``)."""
    def inputs(node: fx.Node):
        return [] if isinstance(node.meta.get("example_value"), (int, torch.SymInt)) else node.all_input_nodes

    return _closure(nodes, inputs)


def descendants(nodes) -> set[fx.Node]:
    """``nodes`` and every node computed from them."""
    return _closure(nodes, lambda node: node.users)


def _closure(nodes, neighbours: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    pending = list(nodes)
    seen: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        pending.extend(neighbours(node))
    return seen


def insert_part(node: fx.Node, op: str, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A node computing part of ``node``'s local form, inserted just before it with its source line,
    module and checkpointed region (so the backward recomputes it with the region)."""
    with node.graph.inserting_before(node):
        new = node.graph.create_node(op, target, args, kwargs or {})
    new.meta.update({key: node.meta[key] for key in ("stack_trace", "nn_module_stack") if key in node.meta})
    copy_recompute_tag(node, new)
    return new


def fill_example_values(new_nodes: list[fx.Node], node: fx.Node) -> None:
    """Example values (fake tensors) and ``node``'s module and source for nodes inserted in its place, in
    order."""
    # The mode of the example values themselves: the tracing context may hold another one by now.
    mode = next(n.meta["example_value"].fake_mode for n in node.all_input_nodes
                if isinstance(n.meta["example_value"], FakeTensor))
    with mode:
        for new in new_nodes:
            args, kwargs = fx.node.map_arg((new.args, new.kwargs), lambda n: n.meta["example_value"])
            if new.op == "call_method":
                value = getattr(args[0], new.target)(*args[1:], **kwargs)
            else:
                value = new.target(*args, **kwargs)
            new.meta["example_value"] = value
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]


def erase_unused(node: fx.Node) -> None:
    """``node`` if nothing uses it, and then what only it used (never a graph input)."""
    if node.users or node.op == "placeholder":
        return
    inputs = node.all_input_nodes
    node.graph.erase_node(node)
    for source in inputs:
        erase_unused(source)


def permute_dims(node: fx.Node) -> tuple:
    """The dims of ``x.permute(*dims)``, ``x.permute(dims)`` or ``torch.permute(x, dims)``, as written."""
    dims = node.args[1:] if len(node.args) > 1 else node.kwargs.get("dims", ())
    return tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def index_entries(index, ndim: int) -> list:
    """``x[index]``'s entries, one per dim of x (plus the ``None`` that insert dims): ``...`` expanded and
    trailing dims filled with full slices."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        named = sum(1 for entry in entries if entry is not None and entry is not Ellipsis)
        entries[at : at + 1] = [slice(None)] * (ndim - named)
    return entries + [slice(None)] * (ndim - sum(1 for entry in entries if entry is not None))


KEYWORD_ALIASES = {"axis": "dim", "keepdims": "keepdim", "dim0": "dim", "source": "dim", "destination": "dim1"}


def method_or_function_args(node: fx.Node, names: tuple[str, ...], defaults: dict | None = None) -> dict:
    """Bind a node's positional and keyword arguments to parameter names (self/input first). numpy-style
    keywords (``axis``, ``keepdims``) and torch's other spellings of dims land on ``dim``/``keepdim``."""
    bound = dict(defaults or {})
    bound.update(zip(names, node.args))
    for key, value in node.kwargs.items():
        bound[KEYWORD_ALIASES.get(key, key) if KEYWORD_ALIASES.get(key) in names else key] = value
    return bound


_WRITES_FIRST_ARGUMENT = frozenset({operator.setitem, *in_place_operators()})  # x[i] = y, x += y, x.__iadd__(y)


_FLAGS_ONLY = frozenset({"requires_grad_", "share_memory_"})  # end in "_" but write no values


_OPERATORS_NAMED_LIKE_WRITES = frozenset({operator.and_, operator.or_, operator.not_})  # a & b: a new tensor


def mutated_arg(node: fx.Node):
    """The argument an op writes into: ``x.add_(y)``, ``x += y``, ``x[i] = y``, ``F.relu(x, inplace=True)``."""
    if node.op == "call_method" and (node.target.endswith("_") and not node.target.startswith("__")
                                     and node.target not in _FLAGS_ONLY or node.target in _WRITES_FIRST_ARGUMENT):
        return node.args[0]
    if isinstance(node.kwargs.get("out"), fx.Node):
        return node.kwargs["out"]  # torch.add(a, b, out=buffer)
    if node.op != "call_function" or not node.args:
        return None
    name = getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.startswith("_") and isinstance(node.args[0], fx.Node) \
            and node.target not in _OPERATORS_NAMED_LIKE_WRITES:
        return node.args[0]  # torch.relu_(x), torch.nn.init.zeros_(w)
    if node.target in _WRITES_FIRST_ARGUMENT:
        return node.args[0]
    try:
        bound = inspect.signature(node.target).bind_partial(*node.args, **node.kwargs).arguments
    except (TypeError, ValueError):
        return None
    return node.args[0] if bound.get("inplace") is True else None
