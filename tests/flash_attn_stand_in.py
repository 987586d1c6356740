"""flash-attn's ``flash_attn_func``: the real one where flash-attn is installed (the ``gpu`` extra), else
a CPU stand-in built the way flash-attn builds it.

The stand-in registers the torch ops flash-attn registers (``flash_attn::_flash_attn_forward`` and
``flash_attn::_flash_attn_backward``, same names and signatures, implemented with plain torch math) and
an autograd.Function calling them on ``[batch, seq, heads, head_dim]`` tensors, so Dynamo captures it
exactly as it captures the real package.
"""

from __future__ import annotations

import importlib.util

import torch


REAL = importlib.util.find_spec("flash_attn") is not None


def _repeat_kv(x, heads):
    return x.repeat_interleave(heads // x.shape[2], dim=2)  # flash-attn's native MQA/GQA


def _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes):
    """Masked, scaled scores [B, H, Sq, Sk] in float32, and the softcap's tanh (for the backward)."""
    heads = q.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), _repeat_kv(k, heads).float()) * softmax_scale
    capped = None
    if softcap > 0:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    seq_q, seq_k = q.shape[1], k.shape[1]
    rows = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
    cols = torch.arange(seq_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.view(-1, heads, 1, 1) if alibi_slopes.dim() == 2 else alibi_slopes.view(1, heads, 1, 1)
        scores = scores - slopes * (rows - cols).abs()
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= cols <= rows
    if window_size_left >= 0:
        allowed &= cols >= rows - window_size_left
    if window_size_right >= 0:
        allowed &= cols <= rows + window_size_right
    return scores.masked_fill(~allowed, float("-inf")), capped


def _group_sum(grad, kv_heads):
    batch, seq, heads, dim = grad.shape
    return grad.view(batch, seq, kv_heads, heads // kv_heads, dim).sum(3)


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: torch.Tensor | None, return_softmax: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scores, _ = _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), _repeat_kv(v, q.shape[2]).float())
    return out.to(q.dtype).contiguous(), lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                  alibi_slopes, return_softmax):
    batch, seq, heads, _ = q.shape
    return (torch.empty_like(q), q.new_empty((batch, heads, seq), dtype=torch.float32),
            q.new_empty((0,)), q.new_empty((2,), dtype=torch.int64))


def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
                         dv: torch.Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int, window_size_right: int, softcap: float,
                         alibi_slopes: torch.Tensor | None, deterministic: bool,
                         rng_state: torch.Tensor | None = None) -> torch.Tensor:
    heads = q.shape[2]
    scores, capped = _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes)
    probs = torch.exp(scores - softmax_lse[..., None])
    dout, keys, values = dout.float(), _repeat_kv(k, heads).float(), _repeat_kv(v, heads).float()
    grad_values = torch.einsum("bhqk,bqhd->bkhd", probs, dout)
    grad_probs = torch.einsum("bqhd,bkhd->bhqk", dout, values)
    row_dot = (dout * out.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    grad_scores = probs * (grad_probs - row_dot[..., None])
    if capped is not None:
        grad_scores = grad_scores * (1 - capped**2)
    grad_scores = grad_scores * softmax_scale
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", grad_scores, keys))
    dk.copy_(_group_sum(torch.einsum("bhqk,bqhd->bkhd", grad_scores, q.float()), k.shape[2]))
    dv.copy_(_group_sum(grad_values, v.shape[2]))
    return softmax_lse.new_empty(softmax_lse.shape)


def _backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                   window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    return softmax_lse.new_empty(softmax_lse.shape)


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        out, softmax_lse, _, rng_state = torch.ops.flash_attn._flash_attn_forward(
            q, k, v, dropout_p, softmax_scale, causal=causal, window_size_left=window_size[0],
            window_size_right=window_size[1], softcap=softcap, alibi_slopes=alibi_slopes, return_softmax=False)
        ctx.save_for_backward(q, k, v, out, softmax_lse, rng_state)
        ctx.settings = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
        return out

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic = ctx.settings
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn._flash_attn_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size[0],
            window_size[1], softcap, alibi_slopes, deterministic, rng_state=rng_state)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _stand_in_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs, torch.is_grad_enabled())


if REAL:
    from flash_attn import flash_attn_func
else:
    forward_op = torch.library.custom_op("flash_attn::_flash_attn_forward", _flash_attn_forward, mutates_args=(),
                                         device_types="cpu")
    forward_op.register_fake(_forward_fake)
    backward_op = torch.library.custom_op("flash_attn::_flash_attn_backward", _flash_attn_backward,
                                          mutates_args=("dq", "dk", "dv"), device_types="cpu")
    backward_op.register_fake(_backward_fake)
    flash_attn_func = _stand_in_flash_attn_func
