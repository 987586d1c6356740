"""Sizes that may be symbolic: a graph compiled for dynamic sequence lengths holds ``SymInt`` sizes
(sympy expressions of Dynamo's size symbols, such as ``s27``) instead of ints.

Passes compare sizes with :func:`same_size`, which never adds a guard, and write a size into the
graph with :func:`size_arg`: an int stays an int, a symbolic size becomes nodes that compute it from
the graph's size inputs at run time. A rank's block of a sequence of symbolic length ``s`` is then
``(s + P - 1 - rank) // P`` (``sharding.block_sizes``) in the graph, so one compiled graph serves
every length.

Before (P = 2, rank 1)::

    q = linear(x, w).view(2, s27, 4, 16)

After::

    floordiv = s27 // 2
    q = linear(x, w).view(2, floordiv, 4, 16)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ulysses_compile.core.compat import (
    GraphAppendingTracer,
    PythonReferenceAnalysis,
    free_unbacked_symbols,
    statically_known_true,
    symbol_hints,
    symbolic_expr,
    symbolic_hint,
    sympy_interp,
)


def is_symbolic(value) -> bool:
    return isinstance(value, torch.SymInt)


def size_hint(value) -> int:
    """A size, or a symbolic one's example value (0 for one that has none; no guard is added): for
    comparing costs."""
    return (symbolic_hint(value) or 0) if is_symbolic(value) else int(value)


def as_int(value):
    """A SymInt that is a constant (``(2*s27)//s27`` is 2) as an int; anything else unchanged."""
    if is_symbolic(value) and symbolic_expr(value).is_number:
        return int(symbolic_expr(value))
    return value


def same_size(a, b) -> bool:
    """True when two sizes are equal for every length the graph serves (no guard is added)."""
    if not (is_symbolic(a) or is_symbolic(b)):
        return a == b
    return statically_known_true(a == b)


def agree(a, b, lengths: int = 16) -> bool:
    """Two sizes equal at this call's sizes and the next ``lengths`` ones (each size symbol shifted
    together); a check that adds no guard, for expressions sympy does not simplify, such as the sum of
    every rank's block, which is the length."""
    if not (is_symbolic(a) or is_symbolic(b)):
        return a == b
    if free_unbacked_symbols(a) or free_unbacked_symbols(b):  # sizes read from data: no call's value
        return False
    exprs = [symbolic_expr(x) if is_symbolic(x) else x for x in (a, b)]
    symbols = set().union(*(getattr(e, "free_symbols", set()) for e in exprs))
    hints = symbol_hints(a if is_symbolic(a) else b, symbols)
    for shift in range(lengths):
        values = {symbol: hint + shift for symbol, hint in hints.items()}
        first, second = (e.subs(values) if hasattr(e, "subs") else e for e in exprs)
        if first != second:
            return False
    return True


def pin_length_class(length, world_size: int) -> None:
    """Guard a symbolic sequence length to its class: the same remainder mod P and at least 2P (a
    shorter length is pinned to its value).

    Each rank rewrites the graph with its own block sizes, and torch adds guards while it traces
    (a padding of 0, a block of 1). Such guards differ between ranks, and if a new length failed one
    rank's guards but not another's, only that rank would recompile and the others would wait in a
    collective forever. Within a class every block is ``P``-th of the length plus a constant of the
    rank and at least 2, so those guards hold on every rank or on none; the class guards here, the
    same on every rank, decide when all ranks recompile together."""
    if not is_symbolic(length):
        return
    hint = symbolic_hint(length)
    if hint < 2 * world_size:
        int(length)  # specializes: a guard on this exact length
        return
    bool(length % world_size == hint % world_size)
    bool(length >= 2 * world_size)


def size_arg(graph: fx.Graph, value, before: fx.Node):
    """``value`` (an int, a SymInt, or a tuple/list of them) as a graph argument computed before ``before``."""
    if isinstance(value, (tuple, list)):
        return type(value)(size_arg(graph, item, before) for item in value)
    if not is_symbolic(value):
        return value
    expr = symbolic_expr(value)
    if expr.is_number:
        return int(expr)
    tracer = GraphAppendingTracer(graph)
    with graph.inserting_before(before):
        env = {symbol: fx.Proxy(_symbol_node(graph, symbol), tracer) for symbol in expr.free_symbols}
        return sympy_interp(PythonReferenceAnalysis, env, expr).node


def _symbol_node(graph: fx.Graph, symbol) -> fx.Node:
    """A node holding the value of a size symbol: the SymInt graph input Dynamo made for it, or the size
    of an input tensor's dim."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for node in placeholders:
        value = node.meta.get("example_value")
        if is_symbolic(value) and symbolic_expr(value) == symbol:
            return node
    for node in placeholders:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if is_symbolic(size) and symbolic_expr(size) == symbol:
                    return graph.call_method("size", (node, dim))
    raise KeyError(f"no graph input carries the size {symbol}")
