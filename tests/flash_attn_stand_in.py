"""flash-attn's ``flash_attn_func`` and ``flash_attn_varlen_func``: the real ones where flash-attn is
installed (the ``gpu`` extra), else a CPU stand-in built the way flash-attn builds them.

The stand-in registers the torch ops flash-attn registers (``flash_attn::_flash_attn_forward``,
``_flash_attn_backward``, ``_flash_attn_varlen_forward``, ``_flash_attn_varlen_backward``: same names
and signatures, implemented with plain torch math) and autograd.Functions calling them on
``[batch, seq, heads, head_dim]`` tensors, or on packed ``[total, heads, head_dim]`` ones delimited by
``cu_seqlens``, so Dynamo captures them exactly as it captures the real package.
"""
from __future__ import annotations

import importlib.util

import torch


REAL = importlib.util.find_spec("flash_attn") is not None


def _repeat_kv(x, heads):
    return x.repeat_interleave(heads // x.shape[2], dim=2)  # flash-attn's native MQA/GQA


def _document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Which packed sequence each of ``total`` positions belongs to."""
    return torch.searchsorted(cu_seqlens[1:], torch.arange(total, device=cu_seqlens.device), right=True)


def _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, cu_seqlens=None):
    """Masked, scaled scores [B, H, Sq, Sk] in float32, and the softcap's tanh (for the backward). With
    ``cu_seqlens`` (varlen: one packed sequence, B = 1, equal query and key offsets) a position attends
    only within its own sequence, where the causal and window masks hold as they do on global positions."""
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
    if cu_seqlens is not None:
        allowed &= _document_ids(cu_seqlens, seq_q)[:, None] == _document_ids(cu_seqlens, seq_k)[None, :]
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


def _attend(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
            cu_seqlens=None):
    """The output [B, S, H, D] and the softmax's log-sum-exp [B, H, S]."""
    scores, _ = _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                        cu_seqlens)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), _repeat_kv(v, q.shape[2]).float())
    return out.to(q.dtype).contiguous(), lse


def _attend_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size_left, window_size_right,
                     softcap, alibi_slopes, cu_seqlens=None):
    """dq, dk, dv of :func:`_attend` (float32)."""
    heads = q.shape[2]
    scores, capped = _scores(q, k, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                             cu_seqlens)
    probs = torch.exp(scores - softmax_lse[..., None])
    dout, keys, values = dout.float(), _repeat_kv(k, heads).float(), _repeat_kv(v, heads).float()
    grad_values = torch.einsum("bhqk,bqhd->bkhd", probs, dout)
    grad_probs = torch.einsum("bqhd,bkhd->bhqk", dout, values)
    row_dot = (dout * out.float()).sum(-1).transpose(1, 2)  # [B, H, Sq]
    grad_scores = probs * (grad_probs - row_dot[..., None])
    if capped is not None:
        grad_scores = grad_scores * (1 - capped**2)
    grad_scores = grad_scores * softmax_scale
    return (torch.einsum("bhqk,bkhd->bqhd", grad_scores, keys),
            _group_sum(torch.einsum("bhqk,bqhd->bkhd", grad_scores, q.float()), k.shape[2]),
            _group_sum(grad_values, v.shape[2]))


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: torch.Tensor | None, return_softmax: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse = _attend(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


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
    grads = _attend_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, window_size_left,
                             window_size_right, softcap, alibi_slopes)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    return softmax_lse.new_empty(softmax_lse.shape)


def _backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                   window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    return softmax_lse.new_empty(softmax_lse.shape)


def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
                               block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
                               seqused_k: torch.Tensor | None = None, zero_tensors: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences packed into [total, H, D], delimited by ``cu_seqlens``; the log-sum-exp is [H, total]."""
    _check_packing(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    out, lse = _attend(q[None], k[None], v[None], softmax_scale, causal, window_size_left, window_size_right, softcap,
                       alibi_slopes, cu_seqlens_q)
    return out[0], lse[0], torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    total, heads, _ = q.shape
    return (torch.empty_like(q), q.new_empty((heads, total), dtype=torch.float32), q.new_empty((0,)),
            q.new_empty((2,), dtype=torch.int64))


def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor | None,
                                dk: torch.Tensor | None, dv: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                                softcap: float, alibi_slopes: torch.Tensor | None, deterministic: bool,
                                rng_state: torch.Tensor | None = None, zero_tensors: bool = False) -> torch.Tensor:
    grads = _attend_backward(dout[None], q[None], k[None], v[None], out[None], softmax_lse[None], softmax_scale,
                             causal, window_size_left, window_size_right, softcap, alibi_slopes, cu_seqlens_q)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad[0])
    return softmax_lse.new_empty(softmax_lse.shape)


def _varlen_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                          alibi_slopes, deterministic, rng_state=None, zero_tensors=False):
    return softmax_lse.new_empty(softmax_lse.shape)


def _check_packing(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
    """What the real kernel requires of its arguments (it reads memory out of bounds otherwise), and the
    stand-in's own limit."""
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("the stand-in packs self-attention only: cu_seqlens_q must equal cu_seqlens_k")
    if cu_seqlens_q.dtype != torch.int32 or int(cu_seqlens_q[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens {cu_seqlens_q.tolist()} ({cu_seqlens_q.dtype}) do not delimit {q.shape[0]} "
                         f"packed positions as int32 offsets")
    if max_seqlen_q != int(cu_seqlens_q.diff().max()):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is not the longest sequence {int(cu_seqlens_q.diff().max())}")


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


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        out, softmax_lse, _, rng_state = torch.ops.flash_attn._flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal=causal,
            window_size_left=window_size[0], window_size_right=window_size[1], softcap=softcap,
            alibi_slopes=alibi_slopes, return_softmax=False)
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state)
        ctx.settings = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic)
        return out

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, \
            deterministic = ctx.settings
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn._flash_attn_varlen_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes, deterministic,
            rng_state=rng_state)
        return (dq, dk, dv) + (None,) * 13


def _stand_in_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs, torch.is_grad_enabled())


def _stand_in_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                     block_table=None):
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                     return_attn_probs, torch.is_grad_enabled())


def _register(name: str, fn, fake, mutates_args=()) -> None:
    torch.library.custom_op(f"flash_attn::{name}", fn, mutates_args=mutates_args, device_types="cpu").register_fake(fake)


if REAL:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
else:
    _register("_flash_attn_forward", _flash_attn_forward, _forward_fake)
    _register("_flash_attn_backward", _flash_attn_backward, _backward_fake, mutates_args=("dq", "dk", "dv"))
    _register("_flash_attn_varlen_forward", _flash_attn_varlen_forward, _varlen_forward_fake)
    _register("_flash_attn_varlen_backward", _flash_attn_varlen_backward, _varlen_backward_fake,
              mutates_args=("dq", "dk", "dv"))
    flash_attn_func = _stand_in_flash_attn_func
    flash_attn_varlen_func = _stand_in_flash_attn_varlen_func


def transformers_uses_flash_attn() -> None:
    """Make transformers' ``flash_attention_2`` run on these functions (its own code around them: the
    varlen path for packed sequences, the padding-free kwargs), as it runs the real package on a GPU.
    On fp32 tensors (the CPU tests' dtype; flash-attn itself takes 16-bit ones) transformers logs a
    warning per call, which Dynamo would break the graph at: it is ignored."""
    from transformers import modeling_flash_attention_utils as utils
    from transformers.utils.logging import warning_once

    torch._dynamo.config.ignore_logging_functions.add(warning_once)

    def imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        return flash_attn_func, flash_attn_varlen_func, None, utils._pad_input, utils._unpad_input

    utils._lazy_imports = imports
    utils._loaded_implementation = None
