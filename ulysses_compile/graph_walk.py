"""Walks over an FX graph that passes and Inductor-side graph passes share."""

from __future__ import annotations

import torch.fx as fx


def ancestors(nodes) -> set[fx.Node]:
    """``nodes`` and every node they are computed from, graph inputs included."""
    pending = list(nodes)
    seen: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        pending.extend(node.all_input_nodes)
    return seen
