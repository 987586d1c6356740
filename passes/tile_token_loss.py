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
    loss = ulysses_compile_runtime_token_loss_sum(flat, rows, weight, target, -100)

``token_loss_sum`` (``ulysses_compile/runtime.py``) runs eager's ``cross_entropy`` on the logits chunk
by chunk, upcast to fp32, and saves no logits; its backward recomputes each chunk's logits from ``rows``
and ``weight`` (one more matmul, as ALST's ``TiledFusedLogitsLoss`` does by hand), runs eager's backward
kernels on them and returns the gradients of the hidden states and the weight, none for the logits.
The logits are still computed once, for a caller that reads them; only the loss's own ``[S/P, V]``
buffers go. In one chunk the loss and gradients are eager's bit for bit; in several, the chunks' sums
are added in another order. Left as it is: losses with class weights, label smoothing, probability targets or
``reduction="none"``, logits that are not a bias-free linear's output reshaped to rows, and logits not
in fp32 when they reach the loss.

Pinned on a small model: ``tests/test_pass_goldens.py::test_tile_token_loss``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.runtime import token_loss_sum
from ulysses_compile.sharding import NodeSharding, place, sharding_of

from .rules import insert_part, method_or_function_args
from .rules.losses import PARAMS

_LINEARS = (torch._C._nn.linear, F.linear)
_ROW_VIEWS = frozenset({"view", "reshape", "flatten", "contiguous"})


def tile_token_loss(gm: fx.GraphModule, ctx) -> list[str]:
    """Returns a note for each loss it tiles."""
    notes = []
    for node in list(gm.graph.find_nodes(op="call_function", target=F.cross_entropy)):
        found = _tileable(node)
        if found is None:
            continue
        linear, logits_2d, target, ignore_index = found
        hidden, weight = linear.args[0], linear.args[1]
        width = sharding_of(weight).global_value.shape[1]
        vocab = sharding_of(weight).global_value.shape[0]
        rows = _row_view(node, hidden, width, sharding_of(logits_2d).output)
        flat = _row_view(node, linear, vocab, sharding_of(logits_2d).output)
        loss = insert_part(node, "call_function", token_loss_sum, (flat, rows, weight, target, ignore_index))
        place(loss, NodeSharding(sharding_of(node).output, sharding_of(node).global_value))
        node.replace_all_uses_with(loss)
        _erase_unused(node)
        notes.append(f"{node.name}: the cross-entropy over the [{vocab}]-wide rows of {linear.name} runs in chunks of "
                     f"rows (runtime.token_loss_sum): its log-probabilities and their gradient are never whole")
    return notes


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


def _erase_unused(node: fx.Node) -> None:
    """``node`` and the inputs only it used, back along the chain."""
    while isinstance(node, fx.Node) and not node.users:
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        node.graph.erase_node(node)
        node = source
