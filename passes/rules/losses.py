"""Token-level losses: exact global means over all ranks' tokens.

Logits sharded over tokens meet labels computed globally (shifted, padded) and sliced here to the same
tokens, so shifts across shard boundaries are exact. ``reduction="mean"`` becomes
``all_reduce(sum of local losses) / all_reduce(number of counted tokens)``, honouring ``ignore_index``
and class weights, so shards holding different numbers of valid tokens still give the global mean.
"""

from __future__ import annotations

import functools
import operator

import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.collectives import insert_call, reduce_partial
from ulysses_compile.runtime import counted_tokens
from ulysses_compile.sharding import PARTIAL, REPLICATE, with_dim
from ulysses_compile.sizes import size_arg

from . import Decision, method_or_function_args, register

PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def _localize_mean(node: fx.Node, sharding, ctx, *, denominator: int | None) -> None:
    args = method_or_function_args(node, PARAMS, {"ignore_index": -100})
    node.args = (args["input"], args["target"])
    node.kwargs = {name: args[name] for name in ("weight", "ignore_index", "label_smoothing") if name in args}
    node.kwargs = {**node.kwargs, "reduction": "sum"}
    graph, anchor = node.graph, node.next
    total = insert_call(graph, reduce_partial, (node, ctx.group_name), before=anchor)
    inserted = [total]
    if denominator is None:
        with graph.inserting_before(anchor):
            count = graph.call_function(counted_tokens, (args["target"], args["ignore_index"], args.get("weight")))
        count_total = insert_call(graph, reduce_partial, (count, ctx.group_name), before=anchor)
        inserted += [count, count_total]
    else:
        count_total = size_arg(graph, denominator, before=anchor)
    with graph.inserting_before(anchor):
        loss = graph.call_function(operator.truediv, (total, count_total))
    inserted.append(loss)
    for new in inserted:
        new.meta["ulysses_inserted"] = "global_mean_loss"
    node.replace_all_uses_with(loss, delete_user_cb=lambda user: user not in inserted)


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
