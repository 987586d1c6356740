"""Open up ``torch.nn.MultiheadAttention`` calls, which Dynamo keeps as one opaque call, into the torch
ops they run, so detect_attention finds a scaled_dot_product_attention site inside.

Before (``nn.TransformerEncoderLayer(batch_first=True)``: the layer hands MHA ``[S, B, E]``)::

    query = x.transpose(1, 0)
    mha = F.multi_head_attention_forward(query, query, query, 32, 4, in_proj_weight, in_proj_bias, None,
                                         None, False, 0.0, out_proj_weight, out_proj_bias, training=True,
                                         key_padding_mask=None, need_weights=False, attn_mask=None, ...)
    out = mha[0]

After::

    chunk = in_proj_weight.chunk(3);  chunk_1 = in_proj_bias.chunk(3)
    q = linear(query, chunk[0], chunk_1[0]).view(S, B, 4, 8).permute(1, 2, 0, 3)     # [B, H, S, D]
    k = ...;  v = ...
    attn = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
    out = linear(attn.permute(2, 0, 1, 3).reshape(S, B, 32), out_proj_weight, out_proj_bias)

Masks follow ``F.multi_head_attention_forward``: boolean masks mean "masked out" and become additive
``-inf`` masks, ``attn_mask`` (``[L, S]`` or ``[B*H, L, S]``) and ``key_padding_mask`` (``[B, S]``) add up,
and ``is_causal`` is used as SDPA's flag only when no padding mask is given, as torch does. Variants
this does not open (unbatched inputs, ``bias_k``/``bias_v``, ``add_zero_attn``, ``static_k``/``static_v``,
returned attention weights) stay one call, run replicated, and are reported with the reason.

Pinned on a small model: ``tests/test_pass_goldens.py::test_decompose_multi_head_attention``.
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ulysses_compile.core.fx_graph import fill_example_values
from ulysses_compile.core.report import module_path

MHA_PARAMS = list(inspect.signature(F.multi_head_attention_forward).parameters)


def decompose_multi_head_attention(gm: fx.GraphModule, ctx) -> list[str]:
    """Inline every supported call; returns why each other one is not attention ranks can split."""
    rejected = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.multi_head_attention_forward:
            continue
        args = {**F_DEFAULTS, **dict(zip(MHA_PARAMS, node.args)), **node.kwargs}
        reason = _unsupported(node, args)
        if reason:
            rejected.append(f"{module_path(node) or node.name} (nn.MultiheadAttention): {reason}")
            continue
        _inline(gm, node, args)
    return rejected


F_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(F.multi_head_attention_forward).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}


def _value(arg):
    return arg.meta["example_value"] if isinstance(arg, fx.Node) else arg


def _unsupported(node: fx.Node, args: dict) -> str | None:
    if _value(args["query"]).dim() != 3:
        return "unbatched query (2-D); batch it to [S, B, E] (or [B, S, E] with batch_first=True)"
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if args[name] is not None:
            return f"{name} is set (add_bias_kv / static keys append positions that no rank owns)"
    if args["add_zero_attn"]:
        return "add_zero_attn=True appends a zero position that no rank owns"
    weights = [user for user in node.users if user.target is operator.getitem and user.args[1] == 1]
    if args["need_weights"] and any(user.users for user in weights):
        return "the attention weights are used (need_weights=True); pass need_weights=False"
    return None


def multi_head_attention(query, key, value, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight,
                         v_proj_weight, out_proj_weight, out_proj_bias, attn_mask, key_padding_mask, *, num_heads,
                         sizes, mask_dims, dropout_p, is_causal, dtype):
    """What ``F.multi_head_attention_forward`` computes for batched inputs without extra keys."""
    tgt_len, src_len, batch, embed_dim = sizes
    head_dim = embed_dim // num_heads
    if in_proj_weight is not None:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = q_proj_weight, k_proj_weight, v_proj_weight
    b_q, b_k, b_v = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    q = F.linear(query, w_q, b_q).view(tgt_len, batch, num_heads, head_dim).permute(1, 2, 0, 3)
    k = F.linear(key, w_k, b_k).view(src_len, batch, num_heads, head_dim).permute(1, 2, 0, 3)
    v = F.linear(value, w_v, b_v).view(src_len, batch, num_heads, head_dim).permute(1, 2, 0, 3)
    mask = None
    attn_mask_dims, padding_is_bool, attn_mask_is_bool = mask_dims
    if attn_mask is not None:
        mask = _additive(attn_mask, attn_mask_is_bool, dtype)
        shape = (1, 1, tgt_len, src_len) if attn_mask_dims == 2 else (batch, num_heads, tgt_len, src_len)
        mask = mask.view(shape)
    if key_padding_mask is not None:
        padding = _additive(key_padding_mask, padding_is_bool, dtype).view(batch, 1, 1, src_len)
        mask = padding if mask is None else mask + padding
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len, batch, embed_dim)
    return F.linear(out, out_proj_weight, out_proj_bias)


def _additive(mask, is_bool: bool, dtype):
    if is_bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))
    return mask


TENSOR_ARGS = ("query", "key", "value", "in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
               "v_proj_weight", "out_proj_weight", "out_proj_bias", "attn_mask", "key_padding_mask")


def _inline(gm: fx.GraphModule, node: fx.Node, args: dict) -> None:
    query, key = _value(args["query"]), _value(args["key"])
    attn_mask, padding = _value(args["attn_mask"]), _value(args["key_padding_mask"])
    is_causal = bool(args["is_causal"])
    causal_flag = is_causal and padding is None and not args["need_weights"]
    if causal_flag:
        args = {**args, "attn_mask": None}
        attn_mask = None
    if not args["use_separate_proj_weight"]:
        args = {**args, "q_proj_weight": None, "k_proj_weight": None, "v_proj_weight": None}
    else:
        args = {**args, "in_proj_weight": None}
    options = dict(
        num_heads=args["num_heads"],
        sizes=(query.shape[0], key.shape[0], query.shape[1], query.shape[2]),
        mask_dims=(
            attn_mask.dim() if attn_mask is not None else 0,
            padding is not None and padding.dtype == torch.bool,
            attn_mask is not None and attn_mask.dtype == torch.bool,
        ),
        dropout_p=args["dropout_p"] if args["training"] else 0.0,
        is_causal=causal_flag,
        dtype=query.dtype,
    )
    tracer = fx.proxy.GraphAppendingTracer(gm.graph)
    tensors = {name: fx.Proxy(args[name], tracer) if args[name] is not None else None for name in TENSOR_ARGS}
    before = set(gm.graph.nodes)
    with gm.graph.inserting_before(node):
        output = multi_head_attention(**tensors, **options).node
    fill_example_values([n for n in gm.graph.nodes if n not in before], node)
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == 0:
            user.replace_all_uses_with(output)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
