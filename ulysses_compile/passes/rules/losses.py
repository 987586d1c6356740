"""Token-level losses: exact global means over all ranks' tokens.

Logits sharded over tokens meet labels computed globally (shifted, padded) and sliced here to the same
tokens, so shifts across shard boundaries are exact. ``reduction="mean"`` becomes ``sum of local
losses / number of counted tokens``, both partial sums (all-reduced by redistribute), honouring
``ignore_index`` and class weights, so shards holding different numbers of valid tokens still give the
global mean.
"""

from __future__ import annotations

import functools
import operator

import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.core.fx_graph import insert_part, method_or_function_args
from ulysses_compile.core.runtime import counted_tokens
from ulysses_compile.core.sharding import PARTIAL, REPLICATE, NodeSharding, place, with_dim
from ulysses_compile.core.sizes import size_arg
from ulysses_compile.passes.rules import Decision, register

PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def _localize_mean(node: fx.Node, sharding, ctx, *, denominator: int | None) -> None:
    """``loss(x, t)`` -> ``loss(x, t, reduction="sum") / count``: both terms Partial, the division on
    their sums (redistribute reduces them)."""
    args = method_or_function_args(node, PARAMS, {"ignore_index": -100})
    options = {name: args[name] for name in ("weight", "ignore_index", "label_smoothing") if name in args}
    total = insert_part(node, "call_function", node.target, (args["input"], args["target"]),
                        {**options, "reduction": "sum"})
    place(total, NodeSharding(PARTIAL, sharding.global_value, sharding.inputs))
    if denominator is None:
        count = insert_part(node, "call_function", counted_tokens,
                            (args["target"], args["ignore_index"], args.get("weight")))
        place(count, NodeSharding(PARTIAL, None, {arg: want for arg, want in sharding.inputs.items()
                                                  if arg is not args["input"]}))
    else:
        count = size_arg(node.graph, denominator, before=node)
    node.target, node.args, node.kwargs = operator.truediv, (total, count), {}
    place(node, NodeSharding(REPLICATE, sharding.global_value,
                             {arg: REPLICATE for arg in (total, count) if isinstance(arg, fx.Node)}))


@register(F.cross_entropy, F.nll_loss)
def token_loss_rule(node, view):
    args = method_or_function_args(node, PARAMS)
    logits, target = args["input"], args["target"]
    factors = view.sharded(logits)
    if factors is None:
        return None
    logits_value, target_value = view.value(logits), view.value(target)
    class_dim = 1 if logits_value.dim() > 1 else 0
    token_dim = factors[0]
    if token_dim == class_dim:
        return None
    placement = view.placement(logits)
    per_token = with_dim(placement, token_dim - (1 if token_dim > class_dim else 0))
    probabilities = target_value.dtype.is_floating_point
    demands = {logits: placement, target: placement if probabilities else per_token}
    weight = args.get("weight")
    if isinstance(weight, fx.Node):
        demands[weight] = REPLICATE
    if args.get("size_average") is not None or args.get("reduce") is not None:
        return None
    reduction = args.get("reduction", "mean")
    if reduction == "none":
        return Decision(per_token, demands)
    if reduction == "sum":
        return Decision(PARTIAL, demands)
    if reduction != "mean" or (args.get("label_smoothing") and weight is not None):
        return None
    denominator = logits_value.numel() // logits_value.shape[class_dim] if probabilities else None
    return Decision(REPLICATE, demands, functools.partial(_localize_mean, denominator=denominator))
