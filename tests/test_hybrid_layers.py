"""The layers of hybrid long-context models beside attention, on the rank's block of the sequence: a
short causal convolution (LFM2's, Mamba's: ``nn.Conv1d`` padded by k - 1 on both sides, its first S
outputs kept) convolves each rank's block with the k - 1 rows before it (``rows_before``), never the
gathered sequence; loss, logits and every gradient equal eager's."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import token_batch
from multirank import run_ranks, step_against_eager

from ulysses_compile.core.runtime import causal_conv1d


def tiny_lfm2():
    """transformers' LFM2: a short-convolution layer, then an attention layer."""
    import transformers

    torch.manual_seed(0)
    return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"], max_position_embeddings=256))


class GatedConvolution(nn.Module):
    """A gated short convolution as people write one (Hyena's, LFM2's): depthwise, causal by padding
    and slicing, here with a dilation."""

    def __init__(self, dim: int, kernel: int, dilation: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, dilation=dilation, padding=dilation * (kernel - 1))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):  # [B, S, D]
        gate, key, value = self.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)
        mixed = self.conv(key * value)[..., :x.shape[1]]
        return self.out_proj((gate * mixed).transpose(-1, -2))


class HybridLM(nn.Module):
    """Embedding, a gated convolution, causal self-attention, an LM head: plain PyTorch."""

    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, kernel: int = 4, dilation: int = 2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.mixer = GatedConvolution(dim, kernel, dilation)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, targets):
        x = self.embed(ids)
        x = x + self.mixer(x)
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def _assert_convolutions_on_blocks(reports, convolutions: int):
    """Every attention parallelized, each causal convolution on the rank's block with the rows before
    it, nothing gathered."""
    (report,) = reports
    kinds = [call.kind for call in report.collectives]
    assert report.attention_sites and all("parallelized" in site.decision for site in report.attention_sites)
    assert kinds.count("rows_before") == convolutions and "gather_seq" not in kinds, kinds
    assert kinds.count("heads_to_seq") == len(report.attention_sites), kinds
    assert not report.fallbacks and not report.replicated, str(report)


def convolutions_equal_to_eager(rank, world_size, seq):
    ids, labels = token_batch(seq=seq)
    reports = step_against_eager(rank, tiny_lfm2(), input_ids=ids, labels=labels, use_cache=False)
    _assert_convolutions_on_blocks(reports, 1)

    torch.manual_seed(0)
    ids, targets = ids % 96, labels.clamp(min=0) % 96
    _assert_convolutions_on_blocks(step_against_eager(rank, HybridLM(), ids, targets), 1)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, seq", [
    pytest.param(2, 24, id="P2"),
    pytest.param(4, 30, id="P4-uneven", marks=pytest.mark.slow),
])
def test_short_causal_convolutions_run_on_the_rank_blocks_equal_to_eager(world_size, seq):
    """LFM2 and a plain-PyTorch gated convolution (dilation 2: it reaches 6 rows back) at P = 2, and at
    P = 4 over 30 positions (blocks 8, 8, 7, 7)."""
    run_ranks(convolutions_equal_to_eager, world_size, seq)


@pytest.mark.parametrize("kernel, dilation", [(4, 1), (3, 2), (1, 1)])
def test_causal_conv1d_is_the_padded_convolution_sliced(kernel, dilation):
    """The runtime call computes what it replaces, whole and from a block with the rows before it."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 6, 20), torch.randn(6, 1, kernel), torch.randn(6)
    padded = F.conv1d(x, weight, bias, padding=dilation * (kernel - 1), dilation=dilation, groups=6)[..., :20]
    torch.testing.assert_close(causal_conv1d(x, weight, bias, dilation, 6), padded)
    reach = dilation * (kernel - 1)
    block = causal_conv1d(x[..., 10:], weight, bias, dilation, 6, before=x[..., 10 - reach:10])
    torch.testing.assert_close(block, padded[..., 10:])


class Convolution(torch.nn.Module):
    """A depthwise convolution over [B, C, S] and what keeps its outputs, before an attention (so the
    graph is split)."""

    def __init__(self, keep, stride: int = 1, padding=3, second_reader: bool = False):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 4, groups=8, stride=stride, padding=padding)
        self.keep, self.second_reader = keep, second_reader

    def forward(self, x):  # [B, S, C]
        full = self.conv(x.transpose(1, 2))
        y = self.keep(full, x.shape[1]).transpose(1, 2)
        q = k = v = y.unflatten(-1, (2, 4)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out + full.mean() if self.second_reader else out


@pytest.mark.parametrize("conv", [
    pytest.param(Convolution(lambda y, s: y[..., 3:]), id="anti-causal: the last outputs kept"),
    pytest.param(Convolution(lambda y, s: y[..., :s], stride=2, padding=3), id="stride 2"),
    pytest.param(Convolution(lambda y, s: y[..., :s], padding=2), id="padding not k - 1"),
    pytest.param(Convolution(lambda y, s: y, padding="same"), id="padding same"),
    pytest.param(Convolution(lambda y, s: y[..., :s], second_reader=True), id="a second reader"),
    pytest.param(Convolution(lambda y, s: y[..., 1:s + 1]), id="a window shifted by one"),
])
def test_convolutions_that_are_not_causal_are_left_as_they_are(fake_group, conv):
    from graphs import rewritten_graphs

    fake_group(2)
    (gm,) = rewritten_graphs(conv, (torch.randn(2, 16, 8),))
    assert "causal_conv1d" not in gm.code and "rows_before" not in gm.code
    assert gm.meta["ulysses_report"].graphs["recognize_causal_convolution"] == \
        gm.meta["ulysses_report"].graphs["drop_dead_values"]


def test_a_reach_past_the_smallest_block_gathers_with_the_reason(fake_group):
    """A dilation-4 kernel of 4 reaches 12 rows back: at P = 4 over 40 positions (blocks of 10) the
    convolution runs on the gathered sequence, reported."""
    from graphs import rewritten_graphs

    fake_group(4)
    torch.manual_seed(0)
    model = HybridLM(kernel=4, dilation=4)
    ids = torch.randint(0, 96, (2, 40))
    (gm,) = rewritten_graphs(model, (ids, ids))
    report = gm.meta["ulysses_report"]
    assert "causal_conv1d" in gm.code and "rows_before" not in gm.code
    assert [fallback.op for fallback in report.fallbacks] == ["causal_conv1d"], report.fallbacks


class ConvolutionLM(nn.Module):
    """No attention: embedding, two gated short convolutions with residuals, a norm and an LM head."""

    def __init__(self, vocab: int = 96, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mixers = nn.ModuleList(GatedConvolution(dim, 4, dilation) for dilation in (1, 2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, targets):
        x = self.embed(ids)
        for mixer in self.mixers:
            x = x + mixer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def without_attention_equal_to_eager(rank, world_size):
    torch.manual_seed(0)
    ids, targets = token_batch(seq=24)
    ids, targets = ids % 96, targets.clamp(min=0) % 96
    (report,) = step_against_eager(rank, ConvolutionLM(), ids, targets)
    kinds = [call.kind for call in report.collectives]
    assert not report.replicated and len(report.convolutions) == 2 and not report.fallbacks, str(report)
    assert kinds.count("rows_before") == 2 and "gather_seq" not in kinds, kinds


@pytest.mark.multirank
@pytest.mark.slow
def test_a_model_without_attention_runs_its_convolutions_on_the_rank_blocks():
    """A plain-PyTorch model of gated convolutions at P = 2: split, not replicated, nothing gathered,
    and equal to eager (Mamba 2, convolutions and scans: test_state_space_layers.py)."""
    run_ranks(without_attention_equal_to_eager, 2)


def test_a_graph_of_convolutions_without_attention_is_split(fake_group):
    """One process at P = 4 (rank 2): the gated-convolution LM's graph is split (its structure; the slow
    tier checks the values on gloo ranks), both convolutions on the rank's block, nothing gathered."""
    from graphs import rewritten_graphs

    fake_group(4, 2)
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 32))
    (gm,) = rewritten_graphs(ConvolutionLM(), (ids, ids))
    report = gm.meta["ulysses_report"]
    kinds = [call.kind for call in report.collectives]
    assert not report.replicated and not report.fallbacks and len(report.convolutions) == 2, str(report)
    assert kinds.count("rows_before") == 2 and "gather_seq" not in kinds, kinds
