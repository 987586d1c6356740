"""Attention written the ways real code writes it, each in a small model, for structure and numerics tests.

``FORMS[name]()`` returns ``(model, args, kwargs)``; :func:`outputs_of` turns any of their results
into named tensors, the first of which is a scalar to call backward on.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import nanogpt
from models import VOCAB, token_batch, tiny_llama

DIM, HEADS, SEQ = 32, 4, 32


def _features(seq: int = SEQ, seed: int = 3) -> torch.Tensor:
    return torch.randn(2, seq, DIM, generator=torch.Generator().manual_seed(seed))


class _FusedQKV(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)


class EinsumAttention(_FusedQKV):
    """[B, S, H, D] throughout, products as einsum, an additive causal mask, softmax in float32."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        probs = (scores + mask).float().softmax(dim=-1).type_as(q)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        return self.out(out.reshape(b, s, -1))


class BaddbmmAttention(_FusedQKV):
    """Heads merged into the batch, ``[B*H, S, D]``, as older transformers models write it: baddbmm
    adds a causal bias and scales q @ k^T in one call, bmm applies the probabilities."""

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, self.head_dim).transpose(1, 2).reshape(b * self.heads, s, -1)
                   for t in self.qkv(x).chunk(3, dim=-1))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        bias = torch.zeros(b * self.heads, s, s, device=x.device).masked_fill(causal, float("-inf"))
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(self.head_dim))
        out = torch.bmm(F.softmax(scores, dim=-1), v)
        return self.out(out.view(b, self.heads, s, -1).transpose(1, 2).reshape(b, s, d))


class BloomGelu(torch.autograd.Function):
    """Bloom's GeLU: an autograd.Function of elementwise ops, forward and backward written out."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        tanh = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - tanh * tanh) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh))


class ViewsBetweenTheProducts(_FusedQKV):
    """Bloom's eager attention: q, k, v in ``[B*H, S, D]``, ALiBi as baddbmm's ``[B*H, 1, S]`` bias, the
    scores viewed to ``[B, H, S, S]`` for a ``[B, 1, S, S]`` mask and the softmax, and back to
    ``[B*H, S, S]`` for bmm; XGLM's clamp of the masked scores; Bloom's GeLU after it."""

    def forward(self, x):
        b, s, d = x.shape
        fused = self.qkv(x).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * self.heads, s, self.head_dim) for i in range(3))
        slopes = 2.0 ** (-torch.arange(1, self.heads + 1, device=x.device) / 2)
        alibi = (slopes[:, None] * torch.arange(s, device=x.device)[None, :]).repeat(b, 1)[:, None, :]
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=1 / math.sqrt(self.head_dim))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        mask = torch.zeros(b, 1, s, s, device=x.device).masked_fill(causal, torch.finfo(x.dtype).min)
        masked = torch.max(scores.view(b, self.heads, s, -1) + mask, torch.full((), torch.finfo(x.dtype).min))
        probs = F.softmax(masked, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs.view(b * self.heads, s, -1), v)
        return BloomGelu.apply(self.out(out.view(b, self.heads, s, self.head_dim).permute(0, 2, 1, 3).reshape(b, s, d)))


class SinkScaledOutput(_FusedQKV):
    """Granite's sliding-window attention: a learned sink per head scales each query's output by
    ``sigmoid(logsumexp(scores) - sink)``, computed from the scores beside the softmax."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(self.heads))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        causal = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + causal
        sink_scale = (torch.logsumexp(scores, dim=-1) - self.sinks.view(1, -1, 1)).sigmoid()
        out = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        out = out * sink_scale.unsqueeze(-1)
        return self.out(out.transpose(1, 2).reshape(b, s, -1))


class FlashAttention(nn.Module):
    """flash-attn's flash_attn_func on [B, S, H, D], optionally with fewer KV heads, ALiBi slopes per head
    and a sliding window."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, kv_heads: int = HEADS, alibi: bool = False,
                 window: int = -1):
        super().__init__()
        from flash_attn_stand_in import flash_attn_func

        self.attention = flash_attn_func
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, dim // heads, window
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])
        self.register_buffer("alibi", slopes if alibi else None)

    def forward(self, x):
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        out = self.attention(q, k, v, causal=True, alibi_slopes=self.alibi, window_size=(self.window, -1))
        return self.out(out.reshape(b, s, d))


class MaskedSDPA(nn.Module):
    """F.scaled_dot_product_attention with GQA left to SDPA (``enable_gqa``) and a boolean [B, 1, S, S]
    mask (causal and key padding), or with a per-head additive bias [1, H, S, S] (ALiBi-like)."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, kv_heads: int = 2, per_head_bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.per_head_bias = per_head_bias
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, padding):
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        positions = torch.arange(s, device=x.device)
        causal = positions[None, :] <= positions[:, None]
        if self.per_head_bias:
            slopes = torch.arange(1, self.heads + 1, device=x.device).float().view(1, -1, 1, 1) / self.heads
            distance = (positions[None, :] - positions[:, None]).float()
            mask = (slopes * distance).masked_fill(~causal, float("-inf"))
        else:
            mask = causal & ~padding[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.out(out.transpose(1, 2).reshape(b, s, d))


class AttentionWeightsReturned(nn.Module):
    """Hand-written attention whose probabilities are also returned (HF's output_attentions): the
    intermediate is used outside the attention."""

    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
        return (probs @ v).transpose(1, 2).reshape(b, s, d), probs


class OtherSpellings(_FusedQKV):
    """Hand-written attention spelled with the less common names of its ops, three times: the key
    transposed with ``swapaxes``, ``.mT`` and ``permute`` (litgpt's Gemma 2), ``torch.special.softmax``,
    the scale as ``torch.div`` and ``torch.matmul``."""

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = 0
        for key in (k.swapaxes(-1, -2), k.mT, k.permute(0, 1, 3, 2)):
            scores = torch.div(torch.matmul(q, key), math.sqrt(self.head_dim))
            out = out + torch.special.softmax(scores, dim=-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, s, d))


class KeyTransposedByItsPermute(nn.Module):
    """GPT-1's attention (transformers' ``openai-gpt``): k^T made from ``[B, S, H, D]`` in one
    ``permute(0, 2, 3, 1)``, the causal mask a buffer applied as ``w * b + -1e4 * (1 - b)``."""

    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ), persistent=False)

    def split_heads(self, x, k=False):
        x = x.view(*x.shape[:-1], self.heads, x.shape[-1] // self.heads)
        return x.permute(0, 2, 3, 1) if k else x.permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], dim=2)
        q, k, v = self.split_heads(q), self.split_heads(k, k=True), self.split_heads(v)
        w = torch.matmul(q, k) / math.sqrt(v.size(-1))
        b = self.bias[:, :, : w.size(-2), : w.size(-1)]
        w = F.softmax(w * b + -1e4 * (1 - b), dim=-1)
        out = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous()
        return self.out(out.view(*out.shape[:-2], -1))


class FlexDocumentsAlibi(_FusedQKV):
    """FlexAttention as torchtitan writes it: ``[B, H, S, D]``, a block mask built once for the sequence
    (causal within documents, read from a captured document-id buffer; every other head also within a
    window of 8, so the mask has a heads dim) and ALiBi as a ``score_mod`` that reads the head. Frozen:
    FlexAttention has no CPU backward (its gradients are checked on a GPU, tests/test_gpu.py)."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, seq: int = SEQ):
        super().__init__(dim, heads)
        documents = torch.tensor([0] * (seq // 3) + [1] * (seq // 2) + [2] * (seq - seq // 3 - seq // 2))
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads))

        def within_documents(b, h, q_idx, kv_idx):
            windowed = (h % 2 == 0) | (q_idx - kv_idx < 8)
            return (q_idx >= kv_idx) & (documents[q_idx] == documents[kv_idx]) & windowed

        self.block_mask = create_block_mask(within_documents, None, heads, seq, seq, device="cpu")
        self.requires_grad_(False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)

        def alibi(score, batch, head, q_idx, kv_idx):
            return score - self.slopes[head] * (q_idx - kv_idx)

        out = flex_attention(q, k, v, score_mod=alibi, block_mask=self.block_mask)
        return self.out(out.transpose(1, 2).reshape(b, s, d))


class ValueAfterScores(nn.Module):
    """Hand-written attention that projects the values only after the probabilities: v does not exist
    where q and k turn to heads, so each goes by its own all-to-all."""

    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query_key = nn.Linear(dim, 2 * dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k = self.query_key(x).view(b, s, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).masked_fill(causal, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        v = self.value(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, d))


class NotAttention(nn.Module):
    """Softmax over a non-key dim between two products: a mixing layer, not attention."""

    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.attn = EinsumAttention(dim, heads)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        h = self.attn(x).view(b, s, self.heads, -1).transpose(1, 2)
        mixing = F.softmax(h @ h.transpose(-2, -1), dim=-2)  # normalized over queries, not keys
        return (mixing @ h).transpose(1, 2).reshape(b, s, d)


class HeadlessSDPA(nn.Module):
    """Attention, then SDPA on each sequence as a 2-D ``[S, D]`` query (no head dim): the second cannot
    be split by heads; it is reported and computed on the whole sequence."""

    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.attn = EinsumAttention(dim, heads)

    def forward(self, x):
        h = self.attn(x)
        return torch.stack([F.scaled_dot_product_attention(row, row, row) for row in h.unbind(0)])


class LatentQueries(nn.Module):
    """Perceiver-style cross-attention: the queries are a parameter, so no sequence of the inputs reaches
    them; the keys and values come from the tokens."""

    def __init__(self, heads: int = 4, head_dim: int = 8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.embedding = nn.Embedding(128, 32)
        self.latents = nn.Parameter(torch.randn(1, heads, 6, head_dim))
        self.key_value = nn.Linear(32, 2 * heads * head_dim)
        self.head = nn.Linear(heads * head_dim, 3)

    def forward(self, ids, labels):
        batch, seq = ids.shape
        key, value = self.key_value(self.embedding(ids)).view(batch, seq, 2, self.heads, self.head_dim).unbind(2)
        queries = self.latents.expand(batch, -1, -1, -1)
        out = F.scaled_dot_product_attention(queries, key.transpose(1, 2), value.transpose(1, 2))
        logits = self.head(out.transpose(1, 2).flatten(2).mean(1))
        return logits, F.cross_entropy(logits, labels)


class PaddedSelfAttention(nn.Module):
    """nn.MultiheadAttention called the common way: ``out, _ = mha(x, x, x, key_padding_mask=...)``."""

    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, padding):
        out, _ = self.mha(x, x, x, key_padding_mask=padding)
        return self.norm(x + out)


def _padding(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    padding = torch.zeros(batch, seq, dtype=torch.bool)
    padding[1, seq - 5 :] = True
    return padding


def _encoder_decoder():
    """nn.Transformer with a 32-token source and a 16-token target: causal self-attention in the
    decoder, cross-attention from target to source, padding masks on the source."""
    torch.manual_seed(0)
    model = nn.Transformer(d_model=DIM, nhead=HEADS, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=2 * DIM, dropout=0.0, batch_first=True)
    source, target = _features(SEQ), _features(SEQ // 2, seed=5)
    padding = _padding()
    kwargs = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(SEQ // 2), "tgt_is_causal": True,
              "src_key_padding_mask": padding, "memory_key_padding_mask": padding}
    return model, (source, target), kwargs


def _hf(model, seq: int = SEQ):
    ids, labels = token_batch(seq=seq)
    return model, (), {"input_ids": ids, "labels": labels, "use_cache": False}


def _eager_llama(**config):
    model = tiny_llama(**config)
    model.config._attn_implementation = "eager"
    return model


def _seeded(make):
    def seeded():
        torch.manual_seed(0)  # every rank builds the same weights, as a launcher's ranks would load them
        return make()

    return seeded


FORMS = {
    "nanogpt_manual": lambda: nanogpt.make(seq_len=SEQ, flash=False),
    "einsum_bshd": _seeded(lambda: (EinsumAttention(), (_features(),), {})),
    "baddbmm_merged_heads": _seeded(lambda: (BaddbmmAttention(), (_features(),), {})),
    "sink_scaled_output": _seeded(lambda: (SinkScaledOutput(), (_features(),), {})),
    "views_between_the_products": _seeded(lambda: (ViewsBetweenTheProducts(), (_features(),), {})),
    "views_between_the_products_6_heads": _seeded(lambda: (ViewsBetweenTheProducts(dim=48, heads=6),
                                                           (torch.randn(2, SEQ, 48),), {})),
    "llama_eager_gqa_gathered": lambda: _hf(_eager_llama(heads=8, kv_heads=2, layers=1)),
    "llama_6_heads": lambda: _hf(tiny_llama(heads=6, kv_heads=6, layers=1)),
    "llama_6_heads_gqa_3": lambda: _hf(tiny_llama(heads=6, kv_heads=3, layers=1)),
    "llama_mqa": lambda: _hf(tiny_llama(heads=4, kv_heads=1, layers=1)),
    "nn_mha_key_padding": _seeded(lambda: (PaddedSelfAttention(), (_features(), _padding()), {})),
    "nn_transformer_cross_attention": _encoder_decoder,
    "sdpa_gqa_bool_mask": _seeded(lambda: (MaskedSDPA(), (_features(), _padding()), {})),
    "sdpa_per_head_bias_6_heads": _seeded(lambda: (MaskedSDPA(dim=48, heads=6, kv_heads=6, per_head_bias=True),
                                                   (torch.randn(2, SEQ, 48), _padding()), {})),
    "flex_documents_alibi": _seeded(lambda: (FlexDocumentsAlibi(), (_features(),), {})),
    "other_spellings": _seeded(lambda: (OtherSpellings(), (_features(),), {})),
    "key_transposed_by_its_permute": _seeded(lambda: (KeyTransposedByItsPermute(), (_features(),), {})),
    "attention_weights_returned": _seeded(lambda: (AttentionWeightsReturned(), (_features(),), {})),
    "value_after_scores": _seeded(lambda: (ValueAfterScores(), (_features(),), {})),
    "not_attention_softmax_over_queries": _seeded(lambda: (NotAttention(), (_features(),), {})),
    "sdpa_without_head_dim": _seeded(lambda: (HeadlessSDPA(), (_features(),), {})),
    "flash_attn": _seeded(lambda: (FlashAttention(), (_features(),), {})),
    "flash_attn_gqa_alibi_window": _seeded(lambda: (FlashAttention(kv_heads=2, alibi=True, window=8), (_features(),), {})),
}


def outputs_of(result, seed: int = 4) -> dict[str, torch.Tensor]:
    """Named tensors of a model's result; the first is a scalar loss (a fixed projection for models
    that return features, so every output element gets a distinct gradient)."""
    if hasattr(result, "logits"):
        return {"loss": result.loss, "logits": result.logits}
    if isinstance(result, tuple) and result[-1].dim() == 0:  # nanoGPT: (logits, loss)
        return {"loss": result[1], "logits": result[0]}
    tensors = result if isinstance(result, tuple) else (result,)
    generator = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=generator)).sum() for t in tensors)
    return {"loss": loss, **{f"output {i}": t for i, t in enumerate(tensors)}}


__all__ = ["FORMS", "VOCAB", "LatentQueries", "outputs_of"]
