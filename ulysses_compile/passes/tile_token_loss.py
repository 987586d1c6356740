"""Compute a cross-entropy over a linear layer's output (the LM head's logits) in chunks of rows, so the
backward never holds the rank's whole ``[S/P, V]`` log-probabilities or their gradient.

Before (redistribute's local graph of a model called with labels)::

    logits = torch._C._nn.linear(hidden, weight, None)        # [B, S/P, V]; also returned
    logits_1 = logits.float()
    logits_2 = logits_1.view((B * S/P, V))
    loss = torch.nn.functional.cross_entropy(logits_2, target, ignore_index = -100, reduction = 'sum')

After::

    rows = hidden.reshape(-1, H)
    flat = logits.reshape(-1, V)
    loss = ulysses_compile_core_runtime_token_loss_sum(flat, rows, weight, target, -100)

``token_loss_sum`` (``ulysses_compile/core/runtime.py``) runs eager's ``cross_entropy`` on the logits chunk
by chunk, upcast to fp32, and saves no logits; its backward recomputes each chunk's logits from ``rows``
and ``weight`` (one more matmul, as ALST's ``TiledFusedLogitsLoss`` does by hand), runs eager's backward
kernels on them and returns the gradients of the hidden states and the weight, none for the logits.
In one chunk the loss and gradients are eager's bit for bit; in several, the chunks' sums are added in
another order.

When the logits are otherwise only returned, sequence-sharded and read lazily (a model called with
labels), the graph does not compute them either: the loss computes each chunk's logits itself, the
output returns ``hidden`` in their place and the weight is appended, and the caller gets them computed
when read (``boundary.LinearRows``)::

    token_loss_sum = ulysses_compile_core_runtime_token_loss_sum(None, rows, weight, target, -100)
    return (loss, hidden, weight)           # output 1: linear(hidden, weight) when read

The weight appended here is the value the graph uses; ``return_weight_inputs`` later returns the
graph input it is made from instead (the parameter, or its ZeRO shard), so the graph holds no ``[V, H]``
output for the logits' sake.

Left as it is: losses with class weights, label smoothing, probability targets or
``reduction="none"``, logits that are not a bias-free linear's output reshaped to rows, and logits not
in fp32 when they reach the loss.

Pinned on a small model: ``tests/test_pass_goldens.py::test_tile_token_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.core.fx_graph import erase_unused, insert_part, method_or_function_args
from ulysses_compile.core.ops import spellings
from ulysses_compile.core.runtime import token_loss_sum
from ulysses_compile.core.sharding import NodeSharding, place, sharding_of
from ulysses_compile.passes.rules.losses import PARAMS

_LINEARS = spellings("linear")
_ROW_VIEWS = frozenset({"view", "reshape", "flatten", "contiguous"})


@dataclass
class TiledLosses:
    notes: list[str] = field(default_factory=list)  # one for each loss tiled, and each output computed when read
    computed: dict[int, int] = field(default_factory=dict)  # output position -> position of its weight


def tile_token_loss(gm: fx.GraphModule, ctx, sharded: dict) -> TiledLosses:
    """``sharded``: the outputs that leave the graph sequence-sharded (position -> blocks)."""
    found = TiledLosses()
    (output,) = gm.graph.find_nodes(op="output")
    for node in list(gm.graph.find_nodes(op="call_function", target=F.cross_entropy)):
        tileable = _tileable(node)
        if tileable is None:
            continue
        linear, logits_2d, target, ignore_index = tileable
        hidden, weight = linear.args[0], linear.args[1]
        width = sharding_of(weight).global_value.shape[1]
        vocab = sharding_of(weight).global_value.shape[0]
        rows = _row_view(node, hidden, width, sharding_of(logits_2d).output)
        flat = _row_view(node, linear, vocab, sharding_of(logits_2d).output)
        loss = insert_part(node, "call_function", token_loss_sum, (flat, rows, weight, target, ignore_index))
        place(loss, NodeSharding(sharding_of(node).output, sharding_of(node).global_value))
        node.replace_all_uses_with(loss)
        erase_unused(node)
        found.notes.append(f"{node.name}: the cross-entropy over the [{vocab}]-wide rows of {linear.name} runs in "
                           f"chunks of rows (runtime.token_loss_sum): its log-probabilities and their gradient "
                           f"are never whole")
        position = _returned_only(linear, flat, output, sharded, ctx)
        if position is None:
            continue
        loss.update_arg(0, None)
        gm.graph.erase_node(flat)
        values = list(output.args[0])
        values[position] = hidden
        found.computed[position] = len(values)
        output.args = (type(output.args[0])([*values, weight]),)
        gm.graph.erase_node(linear)
        found.notes.append(f"{linear.name} (output {position}, the logits) is computed from {hidden.name} when "
                           f"read: the graph neither computes nor keeps the [S/P, {vocab}] block")
    return found


def _returned_only(linear: fx.Node, flat: fx.Node, output: fx.Node, sharded: dict, ctx) -> int | None:
    """The output position of ``linear`` when the loss and that output are its only uses, the output leaves
    the graph sharded and read lazily by the caller, and ``linear`` keeps its input's dtype and placement;
    else None. Logits crossing a graph break are computed in the graph: Dynamo reads the tensors it
    hands the next graph (a fake copy, guards) as often as it likes, and a read of logits computed when
    read is collective."""
    values = output.args[0]
    if ctx.options.outputs != "lazy" or not ctx.outputs_to_caller or set(linear.users) != {flat, output} \
            or not isinstance(values, (tuple, list)):
        return None
    positions = [position for position, value in enumerate(values) if value is linear]
    hidden, weight = sharding_of(linear.args[0]), sharding_of(linear.args[1])
    if len(positions) != 1 or positions[0] not in sharded or hidden.output != sharding_of(linear).output \
            or not hidden.global_value.dtype == weight.global_value.dtype == sharding_of(linear).global_value.dtype:
        return None
    return positions[0]


def _tileable(node: fx.Node):
    """(linear, 2-d logits, target, ignore_index) of a summed fp32 cross-entropy over a bias-free
    linear's rows, or None."""
    args = method_or_function_args(node, PARAMS, {"ignore_index": -100, "reduction": "mean"})
    logits, target = args["input"], args["target"]
    if args["reduction"] != "sum" or args.get("weight") is not None or args.get("label_smoothing") \
            or args.get("size_average") is not None or args.get("reduce") is not None:
        return None
    if not isinstance(logits, fx.Node) or not isinstance(target, fx.Node) or sharding_of(logits) is None \
            or sharding_of(target) is None:
        return None
    value, labels = sharding_of(logits).global_value, sharding_of(target).global_value
    if value.dim() != 2 or value.dtype != torch.float32 or labels.dtype.is_floating_point:
        return None
    source = logits
    while _passes_rows_on(source):
        source = source.args[0]
    if source.op != "call_function" or source.target not in _LINEARS or len(source.args) < 2:
        return None
    bias = source.args[2] if len(source.args) > 2 else source.kwargs.get("bias")
    weight = source.args[1]
    if bias is not None or not isinstance(weight, fx.Node) or sharding_of(weight) is None \
            or sharding_of(weight).global_value.dim() != 2 \
            or sharding_of(source).global_value.shape[-1] != value.shape[1]:
        return None
    return source, logits, target, args["ignore_index"]


def _passes_rows_on(node: fx.Node) -> bool:
    """An upcast to fp32, or a view that keeps the last dim's rows in order."""
    if node.op != "call_method" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    value, source = sharding_of(node), sharding_of(node.args[0])
    if value is None or source is None:
        return False
    if node.target == "float" or (node.target == "to" and node.args[1:] == (torch.float32,) and not node.kwargs):
        return True
    return node.target in _ROW_VIEWS and value.global_value.shape[-1] == source.global_value.shape[-1]


def _row_view(before: fx.Node, tensor: fx.Node, width: int, placement) -> fx.Node:
    rows = insert_part(before, "call_method", "reshape", (tensor, -1, width))
    return place(rows, NodeSharding(placement, sharding_of(tensor).global_value.reshape(-1, width)))
