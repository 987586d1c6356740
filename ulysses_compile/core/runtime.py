"""What rewritten graphs call at run time, besides the collectives (``collectives.py``): the passes
insert calls of these functions, and Dynamo-captured graphs keep them as plain calls until AOTAutograd
traces through them. They hold no pass logic and import nothing from the passes.
"""

from __future__ import annotations

import functools

import torch

from ulysses_compile.core.collectives import block_positions
from ulysses_compile.core.compat import autograd_inside_an_op, log_softmax_backward


def attention_output(x, head_axis: int, seq_axis: int, heads_outer: int = 1):
    """Marks where a hand-written attention's result leaves the head-parallel region (identity)."""
    return x


class _FlashAttention(torch.autograd.Function):
    """flash-attn's forward and backward kernels, called through the torch ops flash-attn registers;
    ``packing`` (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) selects the varlen kernels."""

    @staticmethod
    def forward(ctx, q, k, v, packing, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic):
        kernels = torch.ops.flash_attn
        settings = dict(causal=causal, window_size_left=window_size[0], window_size_right=window_size[1],
                        softcap=softcap, alibi_slopes=alibi_slopes, return_softmax=False)
        if packing is None:
            out, softmax_lse, _, rng_state = kernels._flash_attn_forward(q, k, v, dropout_p, softmax_scale, **settings)
        else:
            out, softmax_lse, _, rng_state = kernels._flash_attn_varlen_forward(
                q, k, v, *packing, dropout_p, softmax_scale, **settings)
        ctx.save_for_backward(q, k, v, out, softmax_lse, rng_state)
        ctx.packing = packing
        ctx.settings = (dropout_p, softmax_scale, causal, *window_size, softcap, alibi_slopes, deterministic)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        operands = (grad.contiguous(), q, k, v, out, softmax_lse, dq, dk, dv)
        if ctx.packing is None:
            torch.ops.flash_attn._flash_attn_backward(*operands, *ctx.settings, rng_state=rng_state)
        else:
            torch.ops.flash_attn._flash_attn_varlen_backward(*operands, *ctx.packing, *ctx.settings,
                                                             rng_state=rng_state)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_attention(q, k, v, dropout_p: float, softmax_scale: float, causal: bool, window_size: tuple,
                    softcap: float, alibi_slopes, deterministic: bool):
    """What ``flash_attn_func`` runs, on ``[B, S, H, D]`` (Hkv may be fewer: MQA/GQA)."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    return _FlashAttention.apply(q, k, v, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                 deterministic)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float, softmax_scale: float, causal: bool, window_size: tuple, softcap: float,
                           alibi_slopes, deterministic: bool):
    """What ``flash_attn_varlen_func`` runs, on sequences packed into ``[total, H, D]``."""
    q, k, v = (x.contiguous() for x in (q, k, v))
    packing = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _FlashAttention.apply(q, k, v, packing, dropout_p, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, deterministic)


def causal_conv1d(x, weight, bias, dilation: int, groups: int, before=None):
    """``conv1d`` along x's last dim in which each position sees itself and the ``dilation * (k - 1)``
    positions before it: a convolution padded by that much on both sides whose first outputs are kept
    (Mamba's and LFM2's short convolutions). ``before``: the positions preceding x (for a rank's block of
    the sequence, the end of the block before it); zeros where None."""
    reach = dilation * (weight.shape[-1] - 1)
    extended = torch.nn.functional.pad(x, (reach, 0)) if before is None else torch.cat([before, x], dim=-1)
    return torch.nn.functional.conv1d(extended, weight, bias, dilation=dilation, groups=groups)


def repeat_heads(x, head_axis: int, repeat: int):
    """Each head ``repeat`` times in a row, as HF's repeat_kv does; on this rank's heads only."""
    shape = list(x.shape)
    expanded = x.unsqueeze(head_axis + 1).expand(*shape[: head_axis + 1], repeat, *shape[head_axis + 1 :])
    shape[head_axis] *= repeat
    return expanded.reshape(shape)


def dropout_block(x, p: float, training: bool, shape: tuple, dim: int, outer: int, inner: int, rank,
                  world_size: int, head_tail: int = 0):
    """Dropout of this rank's block with its part of one mask over the whole tensor, computing only the
    block's part: two seeds drawn from the generator (the same on every rank where the generators agree)
    and an element kept where a hash of the seeds and its position in the whole tensor is at least ``p``.
    The blocks' masks are parts of one mask, independent across blocks as on one device, and no rank
    makes the whole tensor's random numbers (a ``torch.rand`` of the whole would be: Inductor realizes
    random ops whole). The mask is not eager's (eager draws element by element from the generator). Past
    2^32 elements, each further 2^32 positions keep a permutation of the first 2^32's mask (the hash is
    one-to-one on 32 bits)."""
    if not training or p == 0:
        return x
    if p == 1:
        return x * 0
    seeds = torch.randint(0, 2**32, (2,), device=x.device)
    positions = block_positions(x, shape, dim, outer, inner, rank, world_size, head_tail)
    hashed = _hash32(_hash32((positions & _LOW_32) ^ seeds[0]) ^ (positions >> 32) ^ seeds[1])
    keep = (hashed >> 8).to(torch.float32) * 2.0**-24 >= p  # 24 bits: exact in float32, uniform in [0, 1)
    return x * keep / (1 - p)


_LOW_32 = (1 << 32) - 1


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of values in [0, 2^32) held in int64 (a multiplier under 2^27, so no
    product overflows, as signed overflow would in generated C++)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _LOW_32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _LOW_32
    return x ^ (x >> 16)


def attention_heads_dropout(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                            scale: float | None = None, enable_gqa: bool = False, *, rank: torch.Tensor):
    """``scaled_dot_product_attention`` (the same parameters) with ``dropout_p`` over this rank's heads,
    their masks drawn independently of every other rank's heads: the kernel draws from the generator,
    which is in the same state on every rank, so heads split over the ranks would share masks. A seed
    drawn from the generator (advancing it alike on every rank) and mixed with the rank seeds the
    kernel's draws, in a forked generator state; the backward redraws the same masks from the same seed
    by recomputing the forward (the kernel's saved mask is not an output a custom op can keep). The
    masks are not eager's."""
    seed = torch.randint(0, 2**62, (), device="cpu")
    return _attention_dropout_ops().attention_heads_dropout(query, key, value, attn_mask, dropout_p, is_causal,
                                                             scale, enable_gqa, seed, rank)


def _rank_seed(seed: torch.Tensor, rank: torch.Tensor) -> int:
    return (int(seed) + 0x9E3779B97F4A7C15 * (int(rank) + 1)) % 2**64  # the golden ratio's 64 bits: seeds far apart


def _seeded_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, rank):
    """The attention with its draws from the rank's seed, in a forked state of the one generator it
    draws from (the CPU's, or its device's). Inputs that require grad make the forward pick the kernel
    the backward's recompute picks (SDPA chooses some kernels by it), so both draw the same masks."""
    device = q.device
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device.index], device_type=device.type):
        if device.type == "cpu":
            torch.default_generator.manual_seed(_rank_seed(seed, rank))
        else:
            module = torch.get_device_module(device)
            with module.device(device):
                module.manual_seed(_rank_seed(seed, rank))
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)


def _attention_for_gradients(q, k, v, attn_mask, settings, seed, rank, mask_grad: bool):
    """The seeded attention recorded by autograd, on detached inputs that require grad."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    mask = attn_mask.detach().requires_grad_() if mask_grad else attn_mask
    with autograd_inside_an_op(), torch.enable_grad():
        out = _seeded_attention(*inputs, mask, *settings, seed, rank)
    return out, inputs + ([mask] if mask_grad else [])


@functools.cache
def _attention_dropout_ops():
    """The seeded attention and its backward as custom ops: a change of the generator's state is not an
    op AOTAutograd can trace, so the kernel call runs inside an op it does not trace into."""

    @torch.library.custom_op("ulysses_compile::attention_heads_dropout", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
                is_causal: bool, scale: float | None, enable_gqa: bool, seed: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        out, _ = _attention_for_gradients(q, k, v, attn_mask, (dropout_p, is_causal, scale, enable_gqa), seed, rank,
                                          mask_grad=False)
        return out.detach().contiguous()

    @forward.register_fake
    def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, rank):
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    @torch.library.custom_op("ulysses_compile::attention_heads_dropout_backward", mutates_args=())
    def backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None,
                    enable_gqa: bool, seed: torch.Tensor, rank: torch.Tensor, mask_grad: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, inputs = _attention_for_gradients(q, k, v, attn_mask, (dropout_p, is_causal, scale, enable_gqa), seed,
                                               rank, mask_grad)
        with autograd_inside_an_op():
            grads = [g.contiguous() for g in torch.autograd.grad(out, inputs, grad)]
        return *grads[:3], grads[3] if mask_grad else q.new_empty(0)

    @backward_op.register_fake
    def _(grad, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, rank, mask_grad):
        return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
                torch.empty_like(attn_mask, memory_format=torch.contiguous_format) if mask_grad else q.new_empty(0))

    def save(ctx, inputs, output):
        q, k, v, attn_mask, *settings, seed, rank = inputs
        ctx.save_for_backward(q, k, v, attn_mask, seed, rank)
        ctx.settings = settings

    def backward(ctx, grad):
        q, k, v, attn_mask, seed, rank = ctx.saved_tensors
        mask_grad = attn_mask is not None and ctx.needs_input_grad[3]
        grad_q, grad_k, grad_v, grad_mask = backward_op(grad, q, k, v, attn_mask, *ctx.settings, seed, rank,
                                                        mask_grad)
        return grad_q, grad_k, grad_v, grad_mask if mask_grad else None, None, None, None, None, None, None

    forward.register_autograd(backward, setup_context=save)
    return torch.ops.ulysses_compile


def counted_tokens(target, ignore_index, weight):
    """The denominator torch uses for reduction="mean": the (weighted) number of non-ignored targets."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum()
    return (weight[target.masked_fill(~valid, 0)] * valid).sum()


def summed_away(x, dim: int):
    """Sum over an empty dim: zeros of ``x``'s dtype, connected to ``x``."""
    return x.sum(dim).to(x.dtype)


def owned_by(x, rank, owner: int):
    """``x`` on rank ``owner``, zeros of its shape and dtype on the others, connected to it: the owner's
    part of a sum, by one code on every rank."""
    return torch.where(torch.as_tensor(rank == owner, device=x.device), x, torch.zeros((), dtype=x.dtype, device=x.device))


def zero_rows(x, dim: int, count: int):
    """``count`` rows of zeros along ``dim`` of an empty ``x``, of its dtype and connected to it."""
    return x.sum(dim, keepdim=True).to(x.dtype).expand(*(count if at == dim else -1 for at in range(x.dim())))


# Elements of the logits one chunk of token_loss_sum holds at a time (16 MiB in fp32).
_CHUNK_ELEMENTS = 2**22
_SUM = 2  # at::Reduction::Sum


def token_loss_sum(logits, hidden, weight, target, ignore_index: int):
    """``cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="sum")`` for
    ``logits = linear(hidden, weight)`` (``[N, V]`` rows), in chunks of rows; its backward recomputes each
    chunk's logits and returns the gradients of ``hidden`` and ``weight``, none for ``logits``
    (ulysses_compile/passes/tile_token_loss.py). With ``logits`` None (nothing else needs them) the forward computes each
    chunk's logits as well. Each chunk computes what eager computes for its rows, in eager's order."""
    return _token_loss_ops().token_loss_sum(logits, hidden, weight, target, ignore_index)


def token_loss_chunk_rows(vocab: int) -> int:
    """The rows of one chunk of :func:`token_loss_sum` (its logits: ``_CHUNK_ELEMENTS``)."""
    return max(1, _CHUNK_ELEMENTS // vocab)


def _chunks(rows: int, vocab: int) -> list[tuple[int, int]]:
    step = token_loss_chunk_rows(vocab)
    return [(start, min(step, rows - start)) for start in range(0, rows, step)]


@functools.cache
def _token_loss_ops():
    """The loss and its backward as custom ops (registered on first use), so AOTAutograd and Inductor
    see one call for any number of rows, where a Python loop would be unrolled, or could not be for a
    symbolic length. Hand-written: Liger-Kernel's fused linear cross-entropy is Triton (GPU only), and
    torch has none."""

    @torch.library.custom_op("ulysses_compile::token_loss_sum", mutates_args=())
    def forward(logits: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, size in _chunks(hidden.shape[0], weight.shape[0]):
            chunk = torch.nn.functional.linear(hidden.narrow(0, start, size), weight) if logits is None \
                else logits.narrow(0, start, size)
            total += torch.nn.functional.cross_entropy(chunk.float(), target.narrow(0, start, size),
                                                       ignore_index=ignore_index, reduction="sum")
        return total

    @forward.register_fake
    def _(logits, hidden, weight, target, ignore_index):
        return hidden.new_empty((), dtype=torch.float32)

    @torch.library.custom_op("ulysses_compile::token_loss_sum_backward", mutates_args=())
    def backward_op(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                    ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start, size in _chunks(hidden.shape[0], weight.shape[0]):
            chunk, labels = hidden.narrow(0, start, size), target.narrow(0, start, size)
            log_probs = torch.nn.functional.linear(chunk, weight).float().log_softmax(-1)
            # cross_entropy's backward as eager runs it: nll_loss's, then log_softmax's kernels
            grad_log_probs = torch.ops.aten.nll_loss_backward(grad, log_probs, labels, None, _SUM, ignore_index,
                                                              grad.new_ones(()))
            grad_scores = log_softmax_backward(grad_log_probs, log_probs, -1, torch.float32)
            grad_scores = grad_scores.to(hidden.dtype)
            grad_hidden.narrow(0, start, size).copy_(grad_scores @ weight)
            grad_weight += (grad_scores.t() @ chunk).float()
        return grad_hidden, grad_weight.to(weight.dtype)

    @backward_op.register_fake
    def _(grad, hidden, weight, target, ignore_index):
        return torch.empty_like(hidden), torch.empty_like(weight)

    def save(ctx, inputs, output):
        _, hidden, weight, target, ignore_index = inputs
        ctx.save_for_backward(hidden, weight, target)
        ctx.ignore_index = ignore_index

    def backward(ctx, grad):
        hidden, weight, target = ctx.saved_tensors
        grad_hidden, grad_weight = backward_op(grad, hidden, weight, target, ctx.ignore_index)
        return None, grad_hidden, grad_weight, None, None

    forward.register_autograd(backward, setup_context=save)
    return torch.ops.ulysses_compile


# The activations of a gated MLP tiled_gated_mlp runs: name -> (function, its backward kernel)
GATED_MLP_ACTIVATIONS = {
    "silu": (torch.nn.functional.silu, lambda grad, x: torch.ops.aten.silu_backward(grad, x)),
    "gelu": (torch.nn.functional.gelu, lambda grad, x: torch.ops.aten.gelu_backward(grad, x)),
    "gelu_tanh": (functools.partial(torch.nn.functional.gelu, approximate="tanh"),
                  lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh")),
}


def tiled_gated_mlp(x, gate_weight, up_weight, down_weight, activation: str):
    """``linear(act(linear(x, gate_weight)) * linear(x, up_weight), down_weight)`` (Llama's MLP) in
    chunks of rows, each chunk as many rows as the MLP is wide, as ALST's ``TiledMLP`` cuts them: no
    ``[rows, intermediate]`` value is whole, in the forward or the backward, and only ``x`` is saved;
    the backward recomputes each chunk's intermediates (ulysses_compile/passes/tile_mlp.py). Each chunk runs eager's
    kernels on its rows; the weights' gradients are the chunks' sums, in fp32."""
    return _gated_mlp_ops().tiled_gated_mlp(x, gate_weight, up_weight, down_weight, activation)


def _row_chunks(rows: int, width: int) -> list[tuple[int, int]]:
    return [(start, min(width, rows - start)) for start in range(0, rows, width)]


@functools.cache
def _gated_mlp_ops():
    """The MLP and its backward as custom ops, for the reasons of :func:`_token_loss_ops`. Hand-written:
    ALST's ``TiledMLP`` is an autograd function for eager code that a compiled graph cannot hold."""

    @torch.library.custom_op("ulysses_compile::tiled_gated_mlp", mutates_args=())
    def forward(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
                activation: str) -> torch.Tensor:
        act = GATED_MLP_ACTIVATIONS[activation][0]
        out = x.new_empty((*x.shape[:-1], down_weight.shape[0]))
        rows, out_rows = x.reshape(-1, x.shape[-1]), out.view(-1, down_weight.shape[0])
        for start, size in _row_chunks(rows.shape[0], x.shape[-1]):
            chunk = rows.narrow(0, start, size)
            hidden = act(torch.nn.functional.linear(chunk, gate_weight)) * torch.nn.functional.linear(chunk, up_weight)
            out_rows.narrow(0, start, size).copy_(torch.nn.functional.linear(hidden, down_weight))
        return out

    @forward.register_fake
    def _(x, gate_weight, up_weight, down_weight, activation):
        return x.new_empty((*x.shape[:-1], down_weight.shape[0]))

    @torch.library.custom_op("ulysses_compile::tiled_gated_mlp_backward", mutates_args=())
    def backward_op(grad: torch.Tensor, x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                    down_weight: torch.Tensor, activation: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        act, act_backward = GATED_MLP_ACTIVATIONS[activation]
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(x)
        grad_x_rows = grad_x.view(-1, x.shape[-1])
        sums = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in (gate_weight, up_weight, down_weight)]
        for start, size in _row_chunks(rows.shape[0], x.shape[-1]):
            chunk, grad_out = rows.narrow(0, start, size), grad_rows.narrow(0, start, size)
            gate = torch.nn.functional.linear(chunk, gate_weight)
            up = torch.nn.functional.linear(chunk, up_weight)
            activated = act(gate)
            sums[2] += (grad_out.t() @ (activated * up)).float()
            grad_hidden = grad_out @ down_weight
            grad_gate = act_backward(grad_hidden * up, gate)
            grad_up = grad_hidden * activated
            grad_x_rows.narrow(0, start, size).copy_(grad_gate @ gate_weight + grad_up @ up_weight)
            sums[0] += (grad_gate.t() @ chunk).float()
            sums[1] += (grad_up.t() @ chunk).float()
        grad_gate_weight, grad_up_weight, grad_down_weight = (
            total.to(w.dtype) for total, w in zip(sums, (gate_weight, up_weight, down_weight)))
        return grad_x, grad_gate_weight, grad_up_weight, grad_down_weight

    @backward_op.register_fake
    def _(grad, x, gate_weight, up_weight, down_weight, activation):
        return (torch.empty_like(x), torch.empty_like(gate_weight), torch.empty_like(up_weight),
                torch.empty_like(down_weight))

    def save(ctx, inputs, output):
        x, gate_weight, up_weight, down_weight, activation = inputs
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight)
        ctx.activation = activation

    def backward(ctx, grad):
        grads = backward_op(grad, *ctx.saved_tensors, ctx.activation)
        return (*grads, None)

    forward.register_autograd(backward, setup_context=save)
    return torch.ops.ulysses_compile
