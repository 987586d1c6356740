"""Walks over an FX graph that passes and Inductor-side graph passes share."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.fx as fx


def ancestors(nodes) -> set[fx.Node]:
    """``nodes`` and every node they are computed from, graph inputs included."""
    return _closure(nodes, lambda node: node.all_input_nodes)


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
