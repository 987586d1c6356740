"""Which dim of each value holds the sequence, found from how tensors reach attention.

Walking back from every attention's q, k and v (whose sequence dim the site knows), and from every
causal convolution's input (its last dim), through views,
dim shuffles, indexing, splits, embeddings, linear layers and elementwise ops gives, for the values on
the way, the dim that becomes the attention's sequence dim: ``input_ids`` ``[B, S]`` -> 1, a Megatron-style
``[S, B, H]`` input -> 0, whatever the sizes (also when B == S). Propagation seeds sequence sharding with
these dims; where the walk stops at an op it does not know, a dim of the sequence's length is used.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.core.fx_graph import index_entries, method_or_function_args, normalize_dim, permute_dims
from ulysses_compile.core.ops import spellings
from ulysses_compile.core.sharding import seq_factors
from ulysses_compile.passes.rules.shape_ops import SPLITS, TRANSPOSES, UNBINDS, VIEWS, view_placement

PRODUCTS = spellings("linear", "matmul", "bmm")


def sequence_dims(sources, parameters) -> dict[fx.Node, int]:
    """``sources``: (value, its sequence dim) for each value entering a layer that mixes positions."""
    found: dict[fx.Node, int] = {}
    for node, dim in sources:
        while isinstance(node, fx.Node) and node not in found and node not in parameters:
            found[node] = dim
            step = _source_dim(node, dim, parameters)
            if step is None:
                break
            node, dim = step
    return found


def _value(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _source_dim(node: fx.Node, dim: int, parameters) -> tuple[fx.Node, int] | None:
    """The tensor argument of ``node``, and its dim, that become ``node``'s output dim ``dim``."""
    out = _value(node)
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(out, torch.Tensor):
        return None
    source, target = node.args[0], node.target
    value = _value(source)
    if target is operator.getitem and isinstance(value, (tuple, list)):
        return _through_split(source, dim)
    if not isinstance(value, torch.Tensor):
        return None
    if target in VIEWS:
        placement = view_placement(tuple(out.shape), tuple(value.shape), (dim, 1, 1))
        return (source, seq_factors(placement)[0]) if placement is not None else None
    if target in TRANSPOSES:
        args = method_or_function_args(node, ("input", "dim", "dim1"))
        a, b = (normalize_dim(args[name], value.dim()) for name in ("dim", "dim1"))
        return source, b if dim == a else a if dim == b else dim
    if target in spellings("permute"):
        return source, normalize_dim(permute_dims(node)[dim], value.dim())
    if target in spellings("unsqueeze"):
        inserted = normalize_dim(method_or_function_args(node, ("input", "dim"))["dim"], out.dim())
        return None if dim == inserted else (source, dim - (dim > inserted))
    if target is operator.getitem:
        return _through_index(source, value, node.args[1], dim)
    if target in (F.embedding,):
        return (source, dim) if dim < value.dim() else None
    if target in PRODUCTS:
        shifted = dim - (out.dim() - value.dim())
        return (source, shifted) if 0 <= shifted < value.dim() - 1 else None
    return _elementwise(node, out, dim, parameters)


def _through_split(split: fx.Node, dim: int) -> tuple[fx.Node, int] | None:
    source = split.args[0]
    if split.target in SPLITS:
        return source, dim
    if split.target in UNBINDS:
        removed = normalize_dim(method_or_function_args(split, ("input", "dim"), {"dim": 0})["dim"],
                                _value(source).dim())
        return source, dim + (dim >= removed)
    return None


def _through_index(source: fx.Node, value: torch.Tensor, index, dim: int) -> tuple[fx.Node, int] | None:
    entries = index_entries(index, value.dim())
    in_dim = out_dim = 0
    for entry in entries:
        if entry is None:
            if out_dim == dim:
                return None
            out_dim += 1
        elif isinstance(entry, int):
            in_dim += 1
        else:
            if out_dim == dim:
                return (source, in_dim) if isinstance(entry, slice) else None
            in_dim, out_dim = in_dim + 1, out_dim + 1
    return None


def _elementwise(node: fx.Node, out: torch.Tensor, dim: int, parameters) -> tuple[fx.Node, int] | None:
    """Ops that keep every dim in place (pointwise, norms, casts, dropout): the argument aligned from the
    right with a dim of the same size, parameters last."""
    tensors = [arg for arg in node.all_input_nodes if isinstance(_value(arg), torch.Tensor)]
    if any(_value(arg).dim() > out.dim() for arg in tensors):
        return None  # a reduction or another op that drops dims
    candidates = []
    for arg in tensors:
        aligned = dim - (out.dim() - _value(arg).dim())
        if aligned >= 0 and _value(arg).shape[aligned] == out.shape[dim]:
            candidates.append((arg in parameters, arg, aligned))
    if not candidates:
        return None
    _, arg, aligned = min(candidates, key=lambda candidate: candidate[0])
    return arg, aligned
