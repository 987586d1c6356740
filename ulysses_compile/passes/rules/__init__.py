"""Per-op sharding rules, by op family. A rule says how one node runs on sequence-sharded inputs.

A rule is ``fn(node, view) -> Decision | None``. ``view`` gives the placements of the node's inputs as
propagation sees them and their global example values. The rule returns the placement of the output,
the placement each tensor input must arrive in (an input it leaves out must arrive Replicate), and
optionally how to turn the node into its local computation. ``None`` means "no sharded way": the
node then runs on gathered inputs, which is always correct and is recorded as a fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ulysses_compile.core.compat import op_name
from ulysses_compile.core.errors import InternalError
from ulysses_compile.core.sharding import REPLICATE, OutputPlacement, Placement, seq_factors

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
    # The local result is a copy where eager's is a view (a slice whose rows move between ranks): writes
    # to its base after it, or through it, must keep the base whole, as for a view of a gathered copy.
    copies: bool = False


# Localizations written for the sequence in contiguous blocks (a row's neighbour is the next rank's),
# with what they do: where one runs, the graph keeps contiguous blocks (``plan_sequence_layout``).
_CONTIGUOUS_ONLY: dict[Callable, str] = {}


def contiguous_blocks_only(what: str) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        _CONTIGUOUS_ONLY[fn] = what
        return fn

    return wrap


def needs_contiguous_blocks(localize: Callable | None) -> str | None:
    """What a node's localization does that holds for contiguous blocks only, or None."""
    return _CONTIGUOUS_ONLY.get(getattr(localize, "func", localize))


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


def replicate_all(view: RuleView, node: fx.Node) -> dict[fx.Node, Placement]:
    return {arg: REPLICATE for arg in view.tensor_args(node)}


# Importing the families fills the registry.
from ulysses_compile.passes.rules import linalg, losses, pointwise, reductions, routing, shape_ops  # noqa: E402,F401
from ulysses_compile.passes import attention_forms  # noqa: E402,F401  (each form registers the rule of its own calls)
