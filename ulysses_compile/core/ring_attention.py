"""Ring attention: each rank of a ring group keeps its query block and the key/value blocks travel round
the ring, one neighbour to the next; partial results merge by their log-sum-exp in fp32 (or the inputs' dtype where wider).

The forward and its backward are custom ops that AOTAutograd calls rather than traces, so autograd
saves only what the backward reads (the local q, k, v, the output, its log-sum-exp and the mask) instead of
every block's intermediate values, and the backward is a ring of its own: key/value blocks travel
round again and each block's dK/dV accumulates on the ranks it passes, arriving home last. With R
ranks and a contiguous layout (rank i holds the i-th block of the query and of the key/value
sequence):

============  =====================================  ==========================================
pass          rotations                              per step on rank i, block j = i - step
============  =====================================  ==========================================
forward       R - 1 of (k, v)                        attention of q on block j, merged by LSE
backward      R - 1 of (k, v), R - 1 of (dk, dv)     dq += ...; dk_j, dv_j added to what arrived
============  =====================================  ==========================================

Under ``is_causal`` every block j > i is hidden: those steps compute nothing and only pass blocks on
(a causal mask passed as a tensor, with padding say, is computed block by block), so rank i computes
i + 1/2 blocks. In the head-tail layout (``head_tail``: rank i holds the chunks i and 2R - 1 - i of
2R) every rank computes R/2 blocks' worth: its own block causally, the first chunk of each
earlier rank's block, and each later rank's block for its second chunk (``_visible_parts``). At most
two key/value blocks are held at once (the one in use and the one arriving). Key/value heads travel
as they are (grouped-query attention broadcasts them in the kernel: never repeated copies).

A block runs torch's flash attention kernel for CPU, which returns the log-sum-exp and takes it back
in its backward, where it takes the block (4-dim inputs of one head dim, a mask of 2 or 4 dims); else,
and on other devices, an explicit computation in fp32 (the scores of one block at a time).
"""

from __future__ import annotations

import functools
import math

import torch

from ulysses_compile.core.collectives import head_tail_positions, ring_rank, ring_shift
from ulysses_compile.core.compat import flash_attention_cpu, flash_attention_cpu_backward


def ring_attention(query, key, value, attn_mask=None, is_causal: bool = False, scale: float | None = None, *,
                   group_name: str, head_tail: bool = False):
    """``scaled_dot_product_attention`` of this rank's query block over the key/value blocks of every
    rank of the ring ``group_name``: ``query`` ``[B, H, S/R, D]``, ``key``/``value`` ``[B, Hkv, Skv/R, D]``
    (Hkv dividing H), ``attn_mask`` whole (broadcastable to ``[B, H, S, Skv]``), or None. ``head_tail``:
    ring rank i holds the chunks i and 2R - 1 - i of 2R (``collectives.head_tail_positions``), not the
    i-th of R."""
    device = query.device.type
    if torch.is_autocast_enabled(device):  # SDPA's autocast policy: inputs below float64 in the lower precision
        lower = torch.get_autocast_dtype(device)
        query, key, value = (t.to(lower) if t.dtype != torch.float64 else t for t in (query, key, value))
    out, _ = _ring_ops().ring_attention(query, key, value, attn_mask, is_causal, scale, head_tail, group_name)
    return out


def _mask_block(attn_mask, rows: tuple, columns: tuple, size: int, head_tail: bool, dtype):
    """The mask's rows and columns of one part (each ``(ring rank, (start, length) of its block, the
    block's length)``; a broadcast dim stays), additive in ``dtype``."""
    if attn_mask is None:
        return None
    block = attn_mask
    if block.dim() > 1 and block.shape[-2] != 1:
        block = _rows_of(block, -2, *rows, size, head_tail)
    if block.shape[-1] != 1:
        block = _rows_of(block, -1, *columns, size, head_tail)
    if block.dtype == torch.bool:
        return torch.zeros(block.shape, dtype=dtype, device=block.device).masked_fill(~block, float("-inf"))
    return block.to(dtype)


def _rows_of(whole, dim: int, ring_rank: int, part: tuple[int, int], length: int, size: int, head_tail: bool):
    """Rows ``part`` (``(start, length)``) of ring rank ``ring_rank``'s block of ``length`` rows, read
    along ``dim`` of a tensor over the whole sequence: the block's positions are the layout's
    (``collectives.head_tail_positions`` over the ``size`` ring ranks, or the contiguous block)."""
    start, count = part
    if not head_tail:
        return whole.narrow(dim, ring_rank * length + start, count)
    positions = head_tail_positions(size * length, size, size, ring_rank, whole.device)
    return whole.index_select(dim, positions.narrow(0, start, count))


def _block_forward(q, k, v, mask, causal: bool, scale):
    """(output, log-sum-exp in fp32) of ``q`` over one key/value block."""
    if _uses_kernel(q, v, mask):
        out, lse = flash_attention_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        if mask is not None:  # the kernel gives a row the mask hides entirely a log-sum-exp of 0, not -inf
            lse = lse.masked_fill(torch.isneginf(mask).all(-1).expand(lse.shape), float("-inf"))
        return out, lse
    probs, lse = _block_probabilities(q, k, mask, causal, scale, lse=None)
    return probs @ _heads_like(v, q).to(probs.dtype), lse


def _block_backward(grad, q, k, v, out, lse, mask, causal: bool, scale):
    """(dq, dk, dv) of one block, given the whole output and log-sum-exp (the block's probabilities
    are then its share of the whole softmax)."""
    if _uses_kernel(q, v, mask):
        return flash_attention_cpu_backward(grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    probs, _ = _block_probabilities(q, k, mask, causal, scale, lse=lse)
    grad, q, k, v, out = (t.to(probs.dtype) for t in (grad, q, k, v, out))
    grad_v = probs.transpose(-2, -1) @ grad
    grad_probs = grad @ _heads_like(v, q).transpose(-2, -1)
    grad_scores = probs * (grad_probs - (grad * out).sum(-1, keepdim=True))
    scale = _scale(q, scale)
    grad_q = (grad_scores @ _heads_like(k, q)) * scale
    grad_k = (grad_scores.transpose(-2, -1) @ q) * scale
    return grad_q, _summed_heads(grad_k, k), _summed_heads(grad_v, v)


def _accumulated(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results merge in: fp32, or the input's where wider."""
    return torch.promote_types(dtype, torch.float32)


def _uses_kernel(q, v, mask) -> bool:
    """Whether torch's flash kernel for CPU takes the block: 4-dim q, k, v of one head dim, a mask of 2
    or 4 dims."""
    return q.device.type == "cpu" and q.dim() == 4 and q.shape[-1] == v.shape[-1] and (
        mask is None or mask.dim() in (2, 4))


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _block_probabilities(q, k, mask, causal: bool, scale, lse):
    """The block's softmax probabilities (in fp32 or wider) and log-sum-exp: its own, or ``lse`` given."""
    dtype = _accumulated(q.dtype)
    scores = (q.to(dtype) @ _heads_like(k, q).to(dtype).transpose(-2, -1)) * _scale(q, scale)
    if mask is not None:
        scores = scores + mask.to(dtype)
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if lse is None:
        lse = scores.logsumexp(-1)
    hidden = torch.isneginf(lse).unsqueeze(-1)  # a row no key is visible to: probabilities 0
    return torch.where(hidden, 0.0, (scores - lse.unsqueeze(-1)).exp()), lse


def _heads_like(kv, q):
    """Key/value heads repeated to the query's (the explicit computation only; the kernel broadcasts)."""
    repeat = q.shape[-3] // kv.shape[-3]
    return kv if repeat == 1 else kv.repeat_interleave(repeat, dim=-3)


def _summed_heads(grad, kv):
    repeat = grad.shape[-3] // kv.shape[-3]
    return grad if repeat == 1 else grad.unflatten(-3, (kv.shape[-3], repeat)).sum(-3)


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint key sets as one, in fp32; rows masked in both stay zero."""
    dtype = _accumulated(block_out.dtype)
    block_out, block_lse = block_out.to(dtype), block_lse.to(dtype)
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    return (out * (lse - finite).exp().unsqueeze(-1) + block_out * (block_lse - finite).exp().unsqueeze(-1),
            merged)


def _visible_parts(rank: int, block: int, is_causal: bool, head_tail: bool, length: int, kv_length: int) -> list:
    """The parts of the attention of rank ``rank``'s query block over the key/value block of ring rank
    ``block`` that a causal mask leaves visible, each ``(query rows, key rows, causal within)`` with the
    rows as ``(start, length)`` of the local blocks. Contiguous blocks: blocks before the rank's whole,
    its own causal, those after hidden. Head-tail blocks (chunks i and 2R - 1 - i): its own causal; an
    earlier rank's first chunk to all the rank's queries; a later rank's whole block to the rank's second
    chunk: every rank computes the same."""
    everything = ((0, length), (0, kv_length))
    if not is_causal:
        return [(*everything, False)]
    if block == rank:
        return [(*everything, True)]
    if not head_tail:
        return [(*everything, False)] if block < rank else []
    if block < rank:
        return [((0, length), (0, kv_length // 2), False)]
    return [((length // 2, length - length // 2), (0, kv_length), False)]


def causal_work(ring: int, length: int, head_tail: bool) -> list[float]:
    """The query x key elements each rank of a ring of ``ring`` computes for a causal self-attention over
    ``length`` positions (a part causal within counts half)."""
    local = length // ring
    return [sum(rows[1] * columns[1] * (0.5 if causal else 1.0)
                for block in range(ring)
                for rows, columns, causal in _visible_parts(rank, block, True, head_tail, local, local))
            for rank in range(ring)]


def _parts(rank: int, block: int, q, k, attn_mask, is_causal: bool, head_tail: bool, size: int):
    """Each visible part (``_visible_parts``) with its rows and the mask's block for it."""
    length, kv_length = q.shape[-2], k.shape[-2]
    for rows, columns, causal in _visible_parts(rank, block, is_causal, head_tail, length, kv_length):
        mask = _mask_block(attn_mask, (rank, rows, length), (block, columns, kv_length), size, head_tail, q.dtype)
        yield rows, columns, causal, mask


def _ring_forward(q, k, v, attn_mask, is_causal: bool, scale, head_tail: bool, group_name: str):
    rank, size = ring_rank(group_name)
    dtype = _accumulated(q.dtype)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
    for step in range(size):
        block = (rank - step) % size
        arriving = ring_shift([k, v], group_name, tag=0) if step + 1 < size else None
        for rows, columns, causal, mask in _parts(rank, block, q, k, attn_mask, is_causal, head_tail, size):
            part = _block_forward(q.narrow(-2, *rows), k.narrow(-2, *columns), v.narrow(-2, *columns), mask, causal,
                                  scale)
            out_rows, lse_rows = out.narrow(-2, *rows), lse.narrow(-1, *rows)
            merged_out, merged_lse = _merge(out_rows, lse_rows, *part)
            out_rows.copy_(merged_out)
            lse_rows.copy_(merged_lse)
        if arriving is not None:
            k, v = arriving()
    # a row the mask hides from every key: output 0 and log-sum-exp 0, as torch's kernels leave it, so
    # that the backward's probabilities there are exp(-inf - 0) = 0
    return out.to(q.dtype), lse.masked_fill(torch.isneginf(lse), 0.0)


def _ring_backward(grad, q, k, v, out, lse, attn_mask, is_causal: bool, scale, head_tail: bool, group_name: str):
    rank, size = ring_rank(group_name)
    dtype = _accumulated(q.dtype)
    grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)
    passed = None  # the dk, dv accumulated for the block now held, on its way round
    own = None
    for step in range(size):
        block = (rank - step) % size
        arriving = ring_shift([k, v], group_name, tag=0) if step + 1 < size else None
        kv_grads = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (k, v)]
        for rows, columns, causal, mask in _parts(rank, block, q, k, attn_mask, is_causal, head_tail, size):
            grads = _block_backward(grad.narrow(-2, *rows), q.narrow(-2, *rows), k.narrow(-2, *columns),
                                    v.narrow(-2, *columns), out.narrow(-2, *rows), lse.narrow(-1, *rows), mask,
                                    causal, scale)
            grad_q.narrow(-2, *rows).add_(grads[0])
            for total, part in zip(kv_grads, grads[1:]):
                total.narrow(-2, *columns).add_(part)
        if step == 0:
            own = kv_grads
        else:
            if passed is not None:
                kv_grads = [mine + theirs for mine, theirs in zip(kv_grads, passed())]
            passed = ring_shift(kv_grads, group_name, tag=1)
        if arriving is not None:
            k, v = arriving()
    if passed is not None:
        own = [mine + theirs for mine, theirs in zip(own, passed())]
    return grad_q.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


def ring_attention_ops() -> tuple:
    """The forward and backward ops as AOTAutograd's programs call them."""
    ops = _ring_ops()
    return ops.ring_attention.default, ops.ring_attention_backward.default


@functools.cache
def _ring_ops():
    @torch.library.custom_op("ulysses_compile::ring_attention", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                scale: float | None, head_tail: bool, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, enabled=False):  # the caller's autocast reaches an op's body
            out, lse = _ring_forward(q, k, v, attn_mask, is_causal, scale, head_tail, group_name)
        return out.contiguous(), lse.contiguous()

    @forward.register_fake
    def _(q, k, v, attn_mask, is_causal, scale, head_tail, group_name):
        return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=_accumulated(q.dtype))

    @torch.library.custom_op("ulysses_compile::ring_attention_backward", mutates_args=())
    def backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                    head_tail: bool, group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            grads = _ring_backward(grad.contiguous(), q, k, v, out, lse, attn_mask, is_causal, scale, head_tail,
                                   group_name)
        return tuple(g.contiguous() for g in grads)

    @backward_op.register_fake
    def _(grad, q, k, v, out, lse, attn_mask, is_causal, scale, head_tail, group_name):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))

    def save(ctx, inputs, output):
        q, k, v, attn_mask, is_causal, scale, head_tail, group_name = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.settings = (is_causal, scale, head_tail, group_name)
        ctx.mark_non_differentiable(lse)

    def backward(ctx, grad, _grad_lse):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        grad_q, grad_k, grad_v = backward_op(grad, q, k, v, out, lse, attn_mask, *ctx.settings)
        return grad_q, grad_k, grad_v, None, None, None, None, None

    forward.register_autograd(backward, setup_context=save)
    return torch.ops.ulysses_compile
