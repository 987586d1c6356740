"""Small plain-PyTorch models, each using one op the way people write it, around a real attention."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS = 32, 16, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, HEADS, d // HEADS).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class ManualAttention(nn.Module):
    """nanoGPT's attention without flash: a registered causal buffer, masked_fill, softmax, dropout."""

    def __init__(self, block_size: int = 64):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.attn_dropout = nn.Dropout(0.0)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class ComplexRotaryAttention(nn.Module):
    """Rotary embedding by complex multiplication, as torchtitan's and gpt-fast's Llamas write it: a
    registered complex ``freqs_cis`` table, q and k viewed as complex pairs in ``[B, S, H, D/2]``."""

    def __init__(self, max_len: int = 64):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        half = DIM // HEADS // 2
        angles = torch.outer(torch.arange(max_len).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    @staticmethod
    def rotate(x, freqs_cis):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis.view(1, pairs.shape[1], 1, pairs.shape[-1])).flatten(3).type_as(x)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, DIM // HEADS) for w in (self.wq, self.wk, self.wv))
        freqs_cis = self.freqs_cis[:s]
        q, k = self.rotate(q, freqs_cis), self.rotate(k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, DIM))


class SinkAttention(nn.Module):
    """gpt-oss's eager attention written plainly: a learned logit per head joined to the scores as one
    more key column, the row max subtracted (cast back to the scores' dtype), the column dropped."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.sinks = nn.Parameter(torch.randn(HEADS))
        self.register_buffer("causal", torch.tril(torch.ones(64, 64, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, HEADS, d // HEADS).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // HEADS)
        scores = scores.masked_fill(~self.causal[:s, :s], float("-inf"))
        joined = torch.cat([scores, self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)], dim=-1)
        joined = joined - joined.max(dim=-1, keepdim=True).values.to(joined.dtype)
        probs = F.softmax(joined, dim=-1)[..., :-1]
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, d))


class Probe(nn.Module):
    """embedding -> attention -> ``op`` -> head; ``op`` is what the probe tests."""

    def __init__(self, op, attention=Attention, **embedding):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, **embedding)
        self.attn = attention()
        self.head = nn.Linear(DIM, VOCAB)
        self.op = op

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.attn(h)
        return self.head(self.op(h))


def _setitem(h):
    h[:, :, 0] = 0.0
    return h


def _relu_inplace(h):
    h.relu_()
    return h


def _iadd_alias(h):
    acc = torch.zeros(h.shape[0], h.shape[1], h.shape[2])
    alias = acc.view(-1)
    acc += h
    return alias.view_as(h) * 2


def _halves(h):
    first, second = h.chunk(2, axis=2)
    return torch.cat([second, first], axis=2) + h.mean(axis=-1, keepdims=True)


def _dims_by_keyword(h):
    t = h.unsqueeze(dim=1).transpose(dim0=2, dim1=3).squeeze(dim=1).transpose(dim0=1, dim1=2)
    return t * torch.var(h, -1, True, True)


def _matvec_and_norm(h):
    scores = h @ torch.linspace(-1, 1, DIM)
    return h * scores.unsqueeze(-1).tanh() / h.norm(2, -1, True)


def _pool_first_and_cumsum(h):
    first = h[:, 0]
    running = torch.cumsum(h, dim=1) / torch.arange(1, h.shape[1] + 1).view(1, -1, 1)
    return running + first.unsqueeze(1)


def _cumsum_written_in_place_and_reused(h):
    running = torch.cumsum(h, dim=1)
    running.mul_(0.5)  # every later reader sees the write
    return running * running.amax(-1, keepdim=True) + running


def _written_then_gathered(h):
    h = h * 1.0
    h.mul_(2.0)  # a write into a sequence-sharded value after it is made
    return torch.flip(h, dims=(1,)) + h  # flip gathers h: the written h


def _whole_buffer_written_by_tokens(h):
    total = torch.zeros(h.shape)  # whole on every rank
    total.add_(h)  # written in place by a sequence-sharded value
    return total + h


def _halves_written_into_a_new_buffer(h):
    joined = h.new_empty(*h.shape[:-1], DIM)  # as DeepSeek-V3 builds its keys
    joined[..., : DIM // 2].copy_(h[..., DIM // 2 :])
    joined[..., DIM // 2 :].copy_(h[..., : DIM // 2] * 2)
    return joined


def _position_read_around_a_write(h):
    first = h[:, 0]  # a view: the write below changes it too
    before = torch.tanh(first)
    h.mul_(2.0)
    return h + (before + torch.tanh(first)).unsqueeze(1)


def _rows_read_around_a_write(h):
    first = h[:, :1]  # rows inside rank 0's block, a view: the write below changes them too
    before = torch.tanh(first)
    h.mul_(2.0)
    return h + (before + torch.tanh(first))


def _view_read_after_its_base_is_written(h):
    following = h[:, 1:]  # a view across block boundaries, taken before the write below
    h.mul_(2.0)
    return h + F.pad(torch.tanh(following), (0, 0, 0, 1))


def _written_through_a_shifted_view(h):
    h = h.clone()
    h[:, 1:].mul_(2.0)  # the write lands in h through the view
    return h


def _written_through_a_position(h):
    h = h.clone()
    h[:, 0].add_(1.0)  # one position of the sequence, written through its view
    return h


def _flat_view_read_after_a_write(h):
    flat = torch.ravel(h)
    h.mul_(2.0)
    return h + flat.view_as(h)


def _strided_alias(h):
    return h.unfold(1, 1, 1).squeeze(-1)  # the same values, through a view with no sharded form


def _scaled_in_place(h):
    return h.mul_(0.5)


def _sum_written_through_a_view(h):
    total = h.sum(1)
    total.view(-1).add_(1.0)
    return h * torch.tanh(total).unsqueeze(1)


class RightShifted(Probe):
    """Decoder inputs built from labels as T5 and BART build them: a new tensor written in place
    (shifted right by one, a start token, ignored positions replaced), then embedded and sharded."""

    def __init__(self):
        super().__init__(nn.Identity())

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        flat = shifted.view(-1, ids.shape[-1])  # a view taken before the writes, read after them
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 0
        shifted.masked_fill_(shifted == -100, 0)
        return super().forward(flat)


def _interleaved_repeat(h):
    half = torch.tanh(h[..., : h.shape[-1] // 2])
    return h * half.repeat_interleave(2, dim=-1)  # interleaved RoPE's cos/sin (Helium, GLM, Cohere)


def _roll_shift(h):
    return torch.roll(h, shifts=1, dims=1) * 0.5 + h  # each token plus half the one before it, wrapping around: one row between neighbours


def _normalized(h):
    return F.normalize(h, dim=-1) + (h[..., :1] * 0.5).expand_as(h)  # a norm's and a column's expand_as


def _positive_share(h):
    return h * torch.count_nonzero(h > 0, dim=1).unsqueeze(1) / h.shape[1]  # a count over the tokens


def _scaled_features(h):
    return h * torch.linspace(0.5, 1.5, DIM).view(1, 1, DIM).expand_as(h)  # a replicated row, broadcast


def _causal_conv1d(h):
    kernel = torch.linspace(-1, 1, 3 * DIM).view(DIM, 1, 3)  # depthwise, over the sequence, left-padded
    return F.conv1d(F.pad(h.transpose(1, 2), (2, 0)), kernel, groups=DIM).transpose(1, 2)


def _mean_and_max_pool(h):
    return h + h.mean(dim=1, keepdim=True) * h.amax(dim=1, keepdim=True)


def _gather_reversed_positions(h):
    positions = torch.arange(h.shape[1] - 1, -1, -1).view(1, -1, 1).expand_as(h)
    return torch.gather(h, 1, positions) + h


def _top_k_gates(h):
    """A router's top-k: gates scattered over the experts, the chosen scores gathered, a one-hot."""
    probs = h.softmax(dim=-1)
    gates, experts = probs.topk(2, dim=-1)
    dense = torch.zeros_like(probs).scatter(-1, experts, gates)
    chosen = torch.gather(probs, -1, experts).sum(dim=-1, keepdim=True)
    return h * dense + chosen + F.one_hot(experts[..., 0], h.shape[-1]).float()


def _expert_of_each_slot(h):
    flat = h.reshape(-1, h.shape[-1])
    return flat, flat.topk(2, dim=-1).indices.reshape(-1) % 3


def _sorted_rows_put_back(h):
    """transformers' grouped experts: pairs sorted by expert, rows read at their tokens, scaled per
    expert, and put back by the inverse permutation."""
    flat, experts = _expert_of_each_slot(h)
    experts_sorted, perm = torch.sort(experts)
    rows = flat[perm // 2] * (experts_sorted.unsqueeze(-1) + 1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    return rows[inverse].view(flat.shape[0], 2, -1).sum(dim=1).view(h.shape)


def _sorted_rows_added_back(h):
    """A hand-written MoE: argsort by expert, each pair's token and expert weight, index_add_ back."""
    flat, experts = _expert_of_each_slot(h)
    order = experts.argsort()
    tokens = order // 2
    rows = flat[tokens] * (experts[order].unsqueeze(-1) + 1)
    return torch.zeros_like(flat).index_add_(0, tokens, rows).view(h.shape)


def _sorted_rows_scattered_back(h):
    """torchtitan's MoE: tokens gathered in expert order with expanded indices, scatter_add_ back."""
    flat, experts = _expert_of_each_slot(h)
    tokens = (experts.argsort(stable=True) // 2).reshape(-1, 1).expand(-1, flat.shape[-1])
    rows = torch.gather(flat, 0, tokens) * 2 + flat.index_select(0, tokens[:, 0])
    rows = rows.unsqueeze(1).expand(tokens.shape[0], 2, flat.shape[-1]).sum(dim=1)
    return torch.zeros_like(flat).scatter_add_(0, tokens, rows).view(h.shape)


def _sorted_rows_read_unordered(h):
    """Sorted rows read without being put back: the sort must see the whole sequence."""
    flat, experts = _expert_of_each_slot(h)
    rows = flat[experts.argsort() // 2]
    return rows.view(flat.shape[0], 2, -1)[:, 0].view(h.shape) + h


def _sorted_rows_written_then_added_back(h):
    flat, experts = _expert_of_each_slot(h)
    order = experts.argsort()
    rows = flat[order // 2]
    rows[:, 0] = 0.0
    return torch.zeros_like(flat).index_add_(0, order // 2, rows).view(h.shape)


def _sorted_rows_read_at_global_positions(h):
    flat, experts = _expert_of_each_slot(h)
    rows = flat[experts.argsort() // 2]
    positions = (experts * 0 + torch.arange(experts.shape[0])).unsqueeze(-1).expand(-1, h.shape[-1])
    return torch.gather(rows, 0, positions).view(flat.shape[0], 2, -1).sum(dim=1).view(h.shape)


def _counts_over_the_data_range(h):
    """``histc`` with its default range (the data's own min and max) counts over every token."""
    return h * torch.histc(h.argmax(dim=-1).float(), bins=4).max()


def _masked_scatter_into_a_new_buffer(h):
    return torch.zeros_like(h).masked_scatter_(h > 0, h[0, 0].repeat(h.shape[0] * h.shape[1])) + h


# The probes' ops that map the attention's output [B, S, D] to a value of the same shape, some returning
# a view of their input or writing into it: the randomized tests chain them (test_properties.py) and
# read the chain's input again at the end, so writes and views also cross from one step to the next.
STEPS = {
    "setitem": _setitem, "relu_": _relu_inplace, "iadd_alias": _iadd_alias, "axis_keywords": _halves,
    "dim_keywords": _dims_by_keyword, "matvec_norm": _matvec_and_norm, "pool_first_cumsum": _pool_first_and_cumsum,
    "cumsum_in_place_reused": _cumsum_written_in_place_and_reused, "written_then_gathered": _written_then_gathered,
    "whole_buffer_written_by_tokens": _whole_buffer_written_by_tokens,
    "halves_into_new_buffer": _halves_written_into_a_new_buffer,
    "position_read_around_a_write": _position_read_around_a_write,
    "rows_read_around_a_write": _rows_read_around_a_write,
    "sum_written_through_a_view": _sum_written_through_a_view,
    "view_read_after_its_base_is_written": _view_read_after_its_base_is_written,
    "written_through_a_shifted_view": _written_through_a_shifted_view,
    "written_through_a_position": _written_through_a_position,
    "flat_view_read_after_a_write": _flat_view_read_after_a_write, "strided_alias": _strided_alias,
    "scaled_in_place": _scaled_in_place, "repeat_interleave_features": _interleaved_repeat, "roll_shift": _roll_shift, "causal_conv1d": _causal_conv1d,
    "mean_and_max_pool": _mean_and_max_pool, "gather_reversed_positions": _gather_reversed_positions,
    "top_k_gates": _top_k_gates, "sorted_rows_put_back": _sorted_rows_put_back,
    "sorted_rows_added_back": _sorted_rows_added_back, "sorted_rows_read_unordered": _sorted_rows_read_unordered,
    "sorted_rows_written": _sorted_rows_written_then_added_back,
    "sorted_rows_scattered_back": _sorted_rows_scattered_back,
    "sorted_rows_at_global_positions": _sorted_rows_read_at_global_positions,
    "counts_over_the_data_range": _counts_over_the_data_range,
    "masked_scatter_into_new_buffer": _masked_scatter_into_a_new_buffer,
}


def chained(*steps: str) -> Probe:
    """A probe whose op is the named steps applied in order."""
    def chain(first):
        h = first
        for step in steps:
            h = STEPS[step](h)
        return h + 0.5 * first  # sees every write made through a view of it

    return Probe(chain)


PROBES = {
    "setitem": lambda: Probe(_setitem),
    "relu_": lambda: Probe(_relu_inplace),
    "iadd_alias": lambda: Probe(_iadd_alias),
    "axis_keywords": lambda: Probe(_halves),
    "dim_keywords": lambda: Probe(_dims_by_keyword),
    "matvec_norm": lambda: Probe(_matvec_and_norm),
    "pool_first_cumsum": lambda: Probe(_pool_first_and_cumsum),
    "cumsum_in_place_reused": lambda: Probe(_cumsum_written_in_place_and_reused),
    "written_then_gathered": lambda: Probe(_written_then_gathered),
    "whole_buffer_written_by_tokens": lambda: Probe(_whole_buffer_written_by_tokens),
    "right_shifted_inputs": RightShifted,
    "halves_into_new_buffer": lambda: Probe(_halves_written_into_a_new_buffer),
    "position_read_around_a_write": lambda: Probe(_position_read_around_a_write),
    "rows_read_around_a_write": lambda: Probe(_rows_read_around_a_write),
    "sum_written_through_a_view": lambda: Probe(_sum_written_through_a_view),
    "view_read_after_its_base_is_written": lambda: Probe(_view_read_after_its_base_is_written),
    "written_through_a_shifted_view": lambda: Probe(_written_through_a_shifted_view),
    "written_through_a_position": lambda: Probe(_written_through_a_position),
    "flat_view_read_after_a_write": lambda: Probe(_flat_view_read_after_a_write),
    "embedding_scale_grad_by_freq": lambda: Probe(nn.Identity(), scale_grad_by_freq=True),
    "embedding_max_norm": lambda: Probe(nn.Identity(), max_norm=1.0),
    "handwritten_attention": lambda: Probe(nn.Identity(), attention=ManualAttention),
    "repeat_interleave_features": lambda: Probe(_interleaved_repeat),
    "complex_rotary": lambda: Probe(nn.Identity(), attention=ComplexRotaryAttention),
    "attention_sinks": lambda: Probe(nn.Identity(), attention=SinkAttention),
    "roll_shift": lambda: Probe(_roll_shift),
    "normalize_expand_as": lambda: Probe(_normalized),
    "count_nonzero_over_tokens": lambda: Probe(_positive_share),
    "scale_expand_as": lambda: Probe(_scaled_features),
    "causal_conv1d": lambda: Probe(_causal_conv1d),
    "mean_and_max_pool": lambda: Probe(_mean_and_max_pool),
    "gather_reversed_positions": lambda: Probe(_gather_reversed_positions),
    "top_k_gates": lambda: Probe(_top_k_gates),
    "sorted_rows_put_back": lambda: Probe(_sorted_rows_put_back),
    "sorted_rows_added_back": lambda: Probe(_sorted_rows_added_back),
    "sorted_rows_read_unordered": lambda: Probe(_sorted_rows_read_unordered),
    "sorted_rows_written": lambda: Probe(_sorted_rows_written_then_added_back),
    "sorted_rows_scattered_back": lambda: Probe(_sorted_rows_scattered_back),
    "sorted_rows_at_global_positions": lambda: Probe(_sorted_rows_read_at_global_positions),
    "counts_over_the_data_range": lambda: Probe(_counts_over_the_data_range),
    "masked_scatter_into_new_buffer": lambda: Probe(_masked_scatter_into_a_new_buffer),
}
