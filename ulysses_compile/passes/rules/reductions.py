"""Reductions and normalizations.

Over dims other than the sequence they stay local. A sum over the sequence becomes ``Partial`` (each
rank sums its block); a mean over it becomes the rank's sum divided by the global count, also
``Partial`` (blocks may differ in size). A cumsum along it is ``PartialScan``: redistribute adds
the totals of the ranks before. Other reductions over the sequence (max, norms, cumprod) fall back.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import insert_part, method_or_function_args, normalize_dim
from ulysses_compile.core.ops import spellings
from ulysses_compile.core.sharding import PARTIAL, REPLICATE, NodeSharding, PartialScan, place, sharding_of, with_dim
from ulysses_compile.core.sizes import size_arg
from ulysses_compile.passes.rules import Decision, register
from ulysses_compile.passes.rules.pointwise import pointwise


def _reduced_dims(node, value, params) -> list[int] | None:
    dim = method_or_function_args(node, params).get("dim")
    if dim is None:
        return list(range(value.dim()))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return [normalize_dim(d, value.dim()) for d in dims]


def _keepdim(node, params) -> bool:
    return bool(method_or_function_args(node, params).get("keepdim", False))


def _mean_as_partial_sum(node: fx.Node, sharding, ctx) -> None:
    """``x.mean(dims)`` -> ``x.sum(dims) / count``, with the global count of the reduced elements."""
    source = node.args[0] if node.args else node.kwargs["input"]
    global_value = sharding_of(source).global_value
    count = math.prod(global_value.shape[d] for d in _reduced_dims(node, global_value, MEAN_PARAMS))
    summed = insert_part(node, node.op, "sum" if node.op == "call_method" else torch.sum, node.args, node.kwargs)
    place(summed, NodeSharding(PARTIAL, sharding.global_value, sharding.inputs))
    node.op, node.target = "call_function", operator.truediv
    node.args, node.kwargs = (summed, size_arg(node.graph, count, before=node)), {}
    place(node, NodeSharding(PARTIAL, sharding.global_value, {summed: PARTIAL}))


def _reduction(partial_ok: bool, scale: bool, params=("input", "dim", "keepdim")):
    def rule(node, view):
        if view.is_tensor(method_or_function_args(node, params).get("dim")):
            return pointwise(node, view)  # torch.max(a, b) and friends are elementwise
        source = node.args[0] if node.args else node.kwargs["input"]
        factors = view.sharded(source)
        if factors is None:
            return None
        value = view.value(source)
        dims = _reduced_dims(node, value, params)
        dim = factors[0]
        outputs = view.value(node)
        if dim in dims:
            if not partial_ok or isinstance(outputs, tuple):
                return None
            return Decision(PARTIAL, {source: view.placement(source)}, _mean_as_partial_sum if scale else None)
        new_dim = dim if _keepdim(node, params) else dim - sum(1 for d in dims if d < dim)
        placement = with_dim(view.placement(source), new_dim)
        if isinstance(outputs, tuple):  # (values, indices)
            placement = tuple(placement for _ in outputs)
        return Decision(placement, {source: view.placement(source)})

    return rule


SUM_PARAMS = ("input", "dim", "keepdim")
register(*spellings("sum", "nansum"))(_reduction(partial_ok=True, scale=False, params=SUM_PARAMS))
MEAN_PARAMS = ("input", "dim", "keepdim")
register(*spellings("mean"))(_reduction(partial_ok=True, scale=True, params=MEAN_PARAMS))
register(*spellings("amax", "amin", "max", "min", "prod", "logsumexp", "all", "any", "argmax", "argmin"))(_reduction(partial_ok=False, scale=False))
register(*spellings("count_nonzero"))(_reduction(partial_ok=True, scale=False, params=("input", "dim")))
register(*spellings("var", "std"))(
    _reduction(partial_ok=False, scale=False, params=("input", "dim", "unbiased", "keepdim"))
)
register(*spellings("norm"))(_reduction(partial_ok=False, scale=False, params=("input", "p", "dim", "keepdim")))


def _along_dim(scan: bool = False, params: tuple[str, ...] = ("input", "dim"), default_dim: int | None = None):
    """Ops along one dim (softmax, cumsum, normalize): local unless that dim is the sequence, where only
    a sum scan stays sharded, as ``PartialScan``: each rank's block lacks the totals of the blocks before
    it."""

    def rule(node, view):
        source = node.args[0] if node.args else node.kwargs["input"]
        factors = view.sharded(source)
        if factors is None:
            return None
        dim = method_or_function_args(node, params, {"dim": default_dim}).get("dim")
        placement = view.placement(source)
        if dim is None:
            return None
        if normalize_dim(dim, view.value(source).dim()) != factors[0]:
            return Decision(placement, {source: placement})
        if not scan or factors[1:] != (1, 1):
            return None
        return Decision(PartialScan(factors[0]), {source: placement})

    return rule


register(*spellings("softmax", "log_softmax", "cumprod"))(_along_dim())
register(*spellings("cumsum"))(_along_dim(scan=True))
register(*spellings("normalize"))(_along_dim(params=("input", "p", "dim", "eps"), default_dim=1))


def _normalization(params: tuple[str, ...], weight_params: tuple[str, ...]):
    def rule(node, view):
        args = method_or_function_args(node, params)
        x = args["input"]
        factors = view.sharded(x)
        if factors is None:
            return None
        normalized = len(args["normalized_shape"])
        if factors[0] >= view.value(x).dim() - normalized:
            return None
        demands = {x: view.placement(x)}
        for name in weight_params:
            if isinstance(args.get(name), fx.Node):
                demands[args[name]] = REPLICATE
        return Decision(view.placement(x), demands)

    return rule


register(*spellings("layer_norm"))(
    _normalization(("input", "normalized_shape", "weight", "bias", "eps"), ("weight", "bias"))
)
register(*spellings("rms_norm"))(_normalization(("input", "normalized_shape", "weight", "eps"), ("weight",)))
