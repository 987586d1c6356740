"""Turn flash-attn calls, which Dynamo captures as an autograd.Function, into one plain call.

Before (``flash_attn_func(q, k, v, causal=True)`` on ``[B, S, H, D]``)::

    out = torch.ops.higher_order.autograd_function_apply(fwd_body_0, bwd_body_0, q, k, v, ...)
    attn = out[0]
    # fwd_body_0 calls torch.ops.flash_attn._flash_attn_forward(q, k, v, 0.0, 0.35, causal=True, ...)

After::

    attn = flash_attention(q, k, v, dropout_p=0.0, softmax_scale=0.35, causal=True, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False)

``flash_attn_varlen_func`` (sequences packed into ``[total, H, D]``, delimited by ``cu_seqlens``, as
transformers runs padding-free batches) becomes ``flash_attention_varlen(q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q=..., max_seqlen_k=..., ...)`` the same way. ``flash_attention`` and
``flash_attention_varlen`` call the same kernels (the torch ops flash-attn registers) with the settings
read off the captured forward and backward; detect_attention then finds them as sites. After the
all-to-all every rank holds the whole packed sequence for its heads, so the global ``cu_seqlens`` apply
unchanged. flash-attn entry points whose forward is not one kernel on q, k, v (packed qkv, paged or
left-padded keys) stay as they are, run replicated, and are reported.

Pinned on a small model: ``tests/test_pass_goldens.py::test_recognize_flash_attention``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ulysses_compile.core.compat import op_name
from ulysses_compile.core.report import module_path
from ulysses_compile.core.runtime import flash_attention, flash_attention_varlen


FLASH_FORWARD = "flash_attn::_flash_attn_forward"
FLASH_BACKWARD = "flash_attn::_flash_attn_backward"
FLASH_VARLEN_FORWARD = "flash_attn::_flash_attn_varlen_forward"
FLASH_VARLEN_BACKWARD = "flash_attn::_flash_attn_varlen_backward"
SETTINGS = ("dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes",
            "return_softmax")
FORWARD_PARAMS = ("q", "k", "v", *SETTINGS)
PACKING = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
VARLEN_FORWARD_PARAMS = ("q", "k", "v", *PACKING, *SETTINGS, "block_table", "leftpad_k", "seqused_k")
DETERMINISTIC_INDEX = {FLASH_BACKWARD: 16, FLASH_VARLEN_BACKWARD: 20}  # in the backward kernel's arguments


def _calls(body: fx.GraphModule, name: str) -> list[fx.Node]:
    return [node for node in body.graph.nodes if op_name(node) == name]


def recognize_flash_attention(gm: fx.GraphModule, ctx) -> list[str]:
    """Rewrite every recognized call; returns why each other flash-attn call is not."""
    rejected = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.autograd_function_apply:
            continue
        forward_body, backward_body = (getattr(gm, arg.target) for arg in node.args[:2])
        forwards = _calls(forward_body, FLASH_FORWARD) + _calls(forward_body, FLASH_VARLEN_FORWARD)
        if not forwards:
            continue
        reason = _rewrite(gm, node, forward_body, backward_body, forwards)
        if reason:
            rejected.append(f"{module_path(node) or node.name} (flash-attn): {reason}")
    return rejected


def _rewrite(gm, node, forward_body, backward_body, forwards) -> str | None:
    if len(forwards) != 1:
        return "more than one flash-attn kernel in one autograd.Function"
    (forward,) = forwards
    varlen = op_name(forward) == FLASH_VARLEN_FORWARD
    settings = dict(zip(VARLEN_FORWARD_PARAMS if varlen else FORWARD_PARAMS, forward.args))
    settings.update(forward.kwargs)
    placeholders = [n for n in forward_body.graph.nodes if n.op == "placeholder"]
    operands = node.args[2:]

    def outer(value):
        """The graph value a body placeholder stands for."""
        if isinstance(value, fx.Node):
            return operands[placeholders.index(value)] if value in placeholders else None
        return value

    tensors = [outer(settings[name]) for name in ("q", "k", "v", *(PACKING[:2] if varlen else ()))]
    if any(value is None for value in tensors):
        return ("q, k, v (or cu_seqlens) reach the kernel through other ops inside the call (packed qkv or kv, or a "
                "head_dim that flash-attn pads to a multiple of 8); call flash_attn_func on q, k, v")
    if any(settings.get(name) is not None for name in ("block_table", "leftpad_k", "seqused_k")):
        return "paged or left-padded keys (block_table, leftpad_k, seqused_k) are decoding with a cache"
    alibi = settings.get("alibi_slopes")
    if isinstance(alibi, fx.Node) and outer(alibi) is None:
        return "alibi_slopes are computed inside the call"
    if settings.get("return_softmax"):
        return "return_attn_probs=True returns per-head probabilities; leave it False"
    outputs = [user for user in node.users if user.target is operator.getitem]
    if any(user.args[1] != 0 for user in outputs) or len(outputs) != len(node.users):
        return "outputs other than the attention result are used"
    backward_name = FLASH_VARLEN_BACKWARD if varlen else FLASH_BACKWARD
    backwards = _calls(backward_body, backward_name)
    index = DETERMINISTIC_INDEX[backward_name]
    deterministic = bool(backwards[0].args[index]) if backwards and len(backwards[0].args) > index else False
    call_kwargs = dict(
        dropout_p=float(settings["dropout_p"]), softmax_scale=float(settings["softmax_scale"]),
        causal=bool(settings.get("causal", False)),
        window_size=(int(settings.get("window_size_left", -1)), int(settings.get("window_size_right", -1))),
        softcap=float(settings.get("softcap", 0.0)), alibi_slopes=outer(alibi), deterministic=deterministic,
    )
    if varlen:
        lengths = {name: outer(settings[name]) for name in PACKING[2:]}
        if any(value is None for value in lengths.values()):
            return "max_seqlen_q / max_seqlen_k are computed inside the call"
        call_kwargs = {**lengths, **call_kwargs}
    with gm.graph.inserting_before(node):
        call = gm.graph.call_function(flash_attention_varlen if varlen else flash_attention, tuple(tensors),
                                      call_kwargs)
    call.meta.update({key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta})
    call.meta["example_value"] = outputs[0].meta["example_value"] if outputs else None
    for user in outputs:
        user.replace_all_uses_with(call)
        gm.graph.erase_node(user)
    bodies = node.args[:2]
    gm.graph.erase_node(node)
    for body in bodies:
        if not body.users:
            gm.graph.erase_node(body)
    gm.delete_all_unused_submodules()
    return None
