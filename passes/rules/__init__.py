"""Per-op sharding rules, by op family. A rule says how one node runs on sequence-sharded inputs.

A rule is ``fn(node, view) -> Decision | None``. ``view`` gives the placements of the node's inputs as
propagation sees them and their global example values. The rule returns the placement of the output,
the placement each tensor input must arrive in (an input it leaves out must arrive Replicate), and
optionally how to turn the node into its local computation. ``None`` means "no sharded way": the
node then runs on gathered inputs, which is always correct and is recorded as a fallback.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ulysses_compile.compat import copy_recompute_tag, op_name
from ulysses_compile.errors import InternalError
from ulysses_compile.ops import in_place_operators
from ulysses_compile.sharding import REPLICATE, OutputPlacement, Placement, seq_factors

Rule = Callable[[fx.Node, "RuleView"], "Decision | None"]
_RULES: dict[object, Rule] = {}
# Rules for nodes reading rows in a rank's own order (routing.py): kept apart, so that no rule written
# for global layouts ever sees them.
_PERMUTED_RULES: dict[object, Rule] = {}


@dataclass
class Decision:
    output: OutputPlacement
    inputs: dict[fx.Node, Placement] = field(default_factory=dict)
    localize: Callable | None = None


def register(*targets, permuted: bool = False) -> Callable[[Rule], Rule]:
    """Targets are functions (``call_function``) or method names (``call_method``); ``permuted``
    registers the rule for nodes that read rows in a rank's own order."""

    def wrap(fn: Rule) -> Rule:
        table = _PERMUTED_RULES if permuted else _RULES
        for target in targets:
            if target in table and table[target] is not fn:
                raise InternalError(f"{getattr(target, '__name__', target)!r} has two sharding rules, "
                                    f"{table[target].__qualname__} and {fn.__qualname__}: register it once")
            table[target] = fn
        return fn

    return wrap


def rule_for(node: fx.Node, permuted: bool = False) -> Rule | None:
    if node.op in ("call_function", "call_method"):
        table = _PERMUTED_RULES if permuted else _RULES
        try:
            rule = table.get(node.target)
        except TypeError:  # unhashable target
            return None
        # A library's operator is registered by its name ("transformers::grouped_mm_fallback"): this
        # package does not import the library that defines it.
        return rule or table.get(op_name(node))
    return None


class RuleView:
    """Placements and global values of a node's inputs, with an optional override used for seeding."""

    def __init__(self, placement_of: Callable[[fx.Node], OutputPlacement], world_size: int, overrides=None):
        self._placement_of = placement_of
        self.world_size = world_size
        self.overrides = overrides or {}

    def overridden(self, overrides: dict) -> "RuleView":
        return RuleView(self._placement_of, self.world_size, {**self.overrides, **overrides})

    def actual_placement(self, arg) -> OutputPlacement:
        """The placement propagation gave ``arg``, ignoring overrides."""
        return self._placement_of(arg)

    def placement(self, arg) -> OutputPlacement:
        if not isinstance(arg, fx.Node):
            return None
        if arg in self.overrides:
            return self.overrides[arg]
        return self._placement_of(arg)

    def sharded(self, arg) -> tuple[int, int, int] | None:
        placement = self.placement(arg)
        return seq_factors(placement) if not isinstance(placement, tuple) and placement is not None else None

    @staticmethod
    def value(arg):
        if isinstance(arg, fx.Node):
            return arg.meta.get("example_value")
        return arg

    def is_tensor(self, arg) -> bool:
        """A tensor, or a tuple of tensors (the output of split, chunk, max(dim)...)."""
        value = self.value(arg)
        if isinstance(value, (tuple, list)):
            return any(isinstance(v, torch.Tensor) for v in value)
        return isinstance(value, torch.Tensor)

    def tensor_args(self, node: fx.Node) -> list[fx.Node]:
        found = []
        fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) if self.is_tensor(n) else None)
        return list(dict.fromkeys(found))


def insert_part(node: fx.Node, op: str, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A node computing part of ``node``'s local form, inserted just before it with its source line,
    module and checkpointed region (so the backward recomputes it with the region)."""
    with node.graph.inserting_before(node):
        new = node.graph.create_node(op, target, args, kwargs or {})
    new.meta.update({key: node.meta[key] for key in ("stack_trace", "nn_module_stack") if key in node.meta})
    copy_recompute_tag(node, new)
    return new


def erase_unused(node: fx.Node) -> None:
    """``node`` if nothing uses it, and then what only it used (never a graph input)."""
    if node.users or node.op == "placeholder":
        return
    inputs = node.all_input_nodes
    node.graph.erase_node(node)
    for source in inputs:
        erase_unused(source)


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def replicate_all(view: RuleView, node: fx.Node) -> dict[fx.Node, Placement]:
    return {arg: REPLICATE for arg in view.tensor_args(node)}


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


# Importing the families fills the registry.
from . import linalg, losses, pointwise, reductions, routing, shape_ops  # noqa: E402,F401
from .. import attention_forms  # noqa: E402,F401  (each form registers the rule of its own calls)
