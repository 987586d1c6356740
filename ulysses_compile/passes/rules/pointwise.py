"""Elementwise ops with broadcasting: the output is sharded where a sharded input lines up with it.

Dropout draws, on every rank, the mask one device would draw and keeps the rank's block.

A replicated operand that spans the whole sequence (RoPE's cos/sin, a learned position table) is
sliced to the rank's block; one that broadcasts over the sequence (a norm weight, a scalar) is used
as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import method_or_function_args, mutated_arg
from ulysses_compile.core.ops import elementwise, elementwise_targets, spellings
from ulysses_compile.core.runtime import dropout_block
from ulysses_compile.core.sharding import REPLICATE, seq_factors, seq_shard
from ulysses_compile.core.sizes import size_arg
from ulysses_compile.passes.rules import Decision, register

CAST_LIKE = ("type_as", "to")  # a cast whose second argument may be a tensor read only for its dtype


@register(*(target for target in elementwise() if target not in CAST_LIKE))
def pointwise(node, view):
    written = mutated_arg(node)
    # Dynamo records no value for an in-place op whose result is unused (``x.requires_grad_()``)
    out = view.value(node) if written is None or view.value(node) is not None else view.value(written)
    return _elementwise(node, view, out, written)


def _elementwise(node, view, out, written) -> Decision | None:
    """The decision for an op whose output ``out`` is elementwise in its tensor inputs."""
    if not isinstance(out, torch.Tensor):
        return None
    inputs = view.tensor_args(node)
    targets = []
    for arg in inputs:
        factors = view.sharded(arg)
        if factors is not None:
            dim, outer, inner = factors
            out_dim = dim + out.dim() - view.value(arg).dim()
            if view.value(arg).shape[dim] != out.shape[out_dim]:
                return None
            targets.append(seq_shard(out_dim, outer, inner))
    if not targets or any(target != targets[0] for target in targets):
        return None
    out_dim, outer, inner = seq_factors(targets[0])
    demands = {}
    for arg in inputs:
        value = view.value(arg)
        dim = out_dim - (out.dim() - value.dim())
        if dim < 0 or value.shape[dim] == 1:
            demands[arg] = REPLICATE
        elif value.shape[dim] == out.shape[out_dim]:
            demands[arg] = seq_shard(dim, outer, inner)
        else:
            return None
    if written is not None and demands.get(written) != view.placement(written):
        return None  # an in-place op must update the tensor it was given, not a converted copy of it
    return Decision(seq_shard(out_dim, outer, inner), demands)


@register(torch.ops.higher_order.autograd_function_apply)
def elementwise_function(node, view):
    """A ``torch.autograd.Function`` whose forward and backward compute only elementwise ops (Bloom's
    GeLU, a hand-written activation): each rank's block by the pointwise rule; else no rule."""
    owner = node.graph.owning_module
    bodies = [getattr(owner, arg.target, None) for arg in node.args[:2]]
    if node.kwargs.get("dirty_idx") or not all(
            isinstance(body, fx.GraphModule) and all(_elementwise_step(step) for step in body.graph.nodes)
            for body in bodies):
        return None  # (ctx.mark_dirty: the forward writes into an input)
    out = view.value(node)
    if isinstance(out, (tuple, list)) and len(out) == 1:  # Dynamo's call returns the forward's tuple
        decision = _elementwise(node, view, out[0], None)
        return decision and Decision((decision.output,), decision.inputs)
    return _elementwise(node, view, out, None)


def _elementwise_step(node: fx.Node) -> bool:
    """An op that computes each element from the elements at its index and writes nothing; Dynamo's bodies
    also switch grad mode around the user's code and take items of tuples (never of tensors: an index)."""
    if node.op in ("placeholder", "output", "get_attr") or node.target is torch._C._set_grad_enabled:
        return True
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and isinstance(node.args[0].meta.get("example_value"), (tuple, list))
    return node.op in ("call_function", "call_method") and node.target in elementwise_targets() \
        and mutated_arg(node) is None


@register(*CAST_LIKE)
def cast_like_rule(node, view):
    return cast_like(node, view, pointwise)


def cast_like(node, view, elementwise):
    """``x.type_as(y)`` / ``x.to(y)`` read only y's dtype and device: x keeps its placement and y stays
    where it is; a cast to a dtype (``x.to(torch.float32)``) is ``elementwise``'s."""
    other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    if not isinstance(other, fx.Node) or not isinstance(view.value(other), torch.Tensor):
        return elementwise(node, view)
    source = node.args[0]
    placement = view.placement(source)
    return Decision(placement, {source: placement, other: view.actual_placement(other)})


DROPOUT_PARAMS = ("input", "p", "training", "inplace")


def _localize_dropout(node, sharding, ctx) -> None:
    args = method_or_function_args(node, DROPOUT_PARAMS, {"p": 0.5, "training": True})
    node.target = dropout_block
    shape = size_arg(node.graph, tuple(sharding.global_value.shape), before=node)
    dim, outer, inner = seq_factors(sharding.output)
    rank = ctx.rank_for(node.graph, sharding.global_value.shape[dim] // (outer * inner))
    node.args = (args["input"], args["p"], args["training"], shape, dim, outer, inner, rank, ctx.world_size,
                 *ctx.layout_args())
    node.kwargs = {}


@register(*spellings("dropout"))
def dropout_rule(node, view):
    args = method_or_function_args(node, DROPOUT_PARAMS)
    x = args["input"]
    if view.sharded(x) is None or args.get("inplace"):
        return None
    return Decision(view.placement(x), {x: view.placement(x)}, _localize_dropout)
