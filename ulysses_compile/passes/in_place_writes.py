"""Which values are written in place, through which aliases: an analysis of a graph, read by
propagate_sharding (an alias of a written value is not where sharding starts) and redistribute (a
written value is converted where each reader reads it).

A node's base is the node whose storage it may share: through ops that may return a view
(``rules.shape_ops.ALIASING``; not indexing by a tensor, which copies) and through the result of an in-place op, which is its target. A base is
written when any of its aliases is the target of an in-place op (``rules.mutated_arg``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import mutated_arg
from ulysses_compile.passes.rules.shape_ops import ALIASING


def alias_bases(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    bases: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        aliases = source is not None and (may_alias(node) or mutated_arg(node) is source)
        bases[node] = bases.get(source, source) if aliases else node
    return bases


def written_bases(graph: fx.Graph, bases: dict[fx.Node, fx.Node]) -> set[fx.Node]:
    written = set()
    for node in graph.nodes:
        target = mutated_arg(node)
        if isinstance(target, fx.Node):
            written.add(bases.get(target, target))
    return written


def may_alias(node: fx.Node) -> bool:
    try:
        return node.op in ("call_function", "call_method") and node.target in ALIASING and not is_gathering_index(node)
    except TypeError:  # an unhashable target
        return False


def is_gathering_index(node: fx.Node) -> bool:
    """``x[ids]`` with a tensor index: advanced indexing, which always copies."""
    if node.target is not operator.getitem or len(node.args) != 2:
        return False
    index = node.args[1]
    entries = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(entry, fx.Node) and isinstance(entry.meta.get("example_value"), torch.Tensor)
               for entry in entries)
