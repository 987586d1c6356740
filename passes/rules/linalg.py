"""Token-wise linear algebra: linear layers, matmuls against weights, embedding lookups.

A token-sharded input gives a token-sharded output; weights stay replicated (their gradients are
summed over ranks by ``sync_grad``, inserted by the redistribute pass).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ulysses_compile.sharding import REPLICATE, with_dim

from . import Decision, method_or_function_args, register


@register(torch._C._nn.linear, F.linear)
def linear_rule(node, view):
    args = method_or_function_args(node, ("input", "weight", "bias"))
    x = args["input"]
    factors = view.sharded(x)
    if factors is None or factors[0] == view.value(x).dim() - 1:
        return None
    demands = {x: view.placement(x), args["weight"]: REPLICATE}
    if isinstance(args.get("bias"), torch.fx.Node):
        demands[args["bias"]] = REPLICATE
    return Decision(view.placement(x), demands)


@register(torch.addmm, "addmm")
def addmm_rule(node, view):
    args = method_or_function_args(node, ("input", "mat1", "mat2"))
    rows = args["mat1"]
    factors = view.sharded(rows)
    if factors is None or factors[0] != 0:
        return None
    bias = args["input"]
    bias_value = view.value(bias)
    bias_placement = view.placement(rows) if bias_value.dim() == 2 and bias_value.shape[0] > 1 else REPLICATE
    return Decision(view.placement(rows), {rows: view.placement(rows), args["mat2"]: REPLICATE, bias: bias_placement})


@register(torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm", torch.mm, "mm")
def matmul_rule(node, view):
    a, b = node.args[:2]
    a_value, b_value, out = view.value(a), view.value(b), view.value(node)
    a_factors, b_factors = view.sharded(a), view.sharded(b)
    if a_factors is not None and b_factors is None and a_value.dim() >= 2:
        dim = a_factors[0]
        if dim == a_value.dim() - 1:
            return None
        if b_value.dim() == 1:  # [.., S, K] @ [K] -> [.., S]
            return Decision(view.placement(a), {a: view.placement(a), b: REPLICATE})
        out_dim = dim + out.dim() - a_value.dim()
        b_dim = dim - (a_value.dim() - b_value.dim())
        if dim < a_value.dim() - 2 and b_dim >= 0 and b_value.shape[b_dim] != 1:
            b_placement = with_dim(view.placement(a), b_dim)
        else:
            b_placement = REPLICATE
        return Decision(with_dim(view.placement(a), out_dim), {a: view.placement(a), b: b_placement})
    if a_factors is not None and b_factors is not None and min(a_value.dim(), b_value.dim()) >= 3:
        # batched matmul of two operands sharded on the same batch dim (heads inside an attention)
        a_dim, b_dim = a_factors[0], b_factors[0]
        out_dim = a_dim + out.dim() - a_value.dim()
        if a_dim < a_value.dim() - 2 and out_dim == b_dim + out.dim() - b_value.dim() and a_factors == (a_dim, 1, 1) \
                and b_factors == (b_dim, 1, 1):
            return Decision(with_dim(view.placement(a), out_dim), {a: view.placement(a), b: view.placement(b)})
        return None
    if b_factors is not None and a_factors is None and b_value.dim() >= 2:
        dim = b_factors[0]
        if dim != b_value.dim() - 1:
            return None
        return Decision(with_dim(view.placement(b), out.dim() - 1), {a: REPLICATE, b: view.placement(b)})
    return None


@register(F.embedding)
def embedding_rule(node, view):
    args = method_or_function_args(node, ("input", "weight", "padding_idx", "max_norm", "norm_type",
                                          "scale_grad_by_freq", "sparse"))
    ids = args["input"]
    if view.sharded(ids) is None or args.get("max_norm") is not None or args.get("scale_grad_by_freq"):
        return None  # both look at the whole batch's ids (max_norm even rewrites the weight in place)
    return Decision(view.placement(ids), {ids: view.placement(ids), args["weight"]: REPLICATE})
