"""FlexAttention as users reach it: transformers' ``attn_implementation="flex_attention"`` under
``torch.compile(model, backend="ulysses")`` as the README writes it. Forward only on CPU (FlexAttention
has no CPU backward; its gradients are checked on a GPU by tests/test_gpu.py); the hand-written
torchtitan-style form with a per-head block mask and a head-reading ``score_mod`` is in
tests/attention_forms.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from graphs import calls, rewritten_graphs
from models import tiny_llama, token_batch
from multirank import assert_close, run_ranks
from ulysses_compile.core.collectives import heads_to_seq, seq_to_heads_qkv


def flex_llama(heads: int = 4, kv_heads: int = 2):
    model = tiny_llama(heads=heads, kv_heads=kv_heads, layers=2)
    model.config._attn_implementation = "flex_attention"
    return model.requires_grad_(False)


def test_transformers_flex_llama_is_parallel_at_every_layer(fake_group):
    fake_group(2)
    ids, labels = token_batch(seq=32)
    graphs = rewritten_graphs(flex_llama(), (), {"input_ids": ids, "labels": labels, "use_cache": False})
    sites = [(gm, site) for gm in graphs for site in gm.meta["ulysses_report"].attention_sites]
    assert [site.spelling for _, site in sites] == ["flex_attention"] * 2
    assert all(site.decision.startswith("parallelized") for _, site in sites)
    (gm,) = {gm for gm, _ in sites}
    assert len(calls(gm, seq_to_heads_qkv)) == len(calls(gm, heads_to_seq)) == 2
    assert gm.meta["ulysses_report"].fallbacks == []


def flex_llama_equal_to_eager(rank, world_size):
    model = flex_llama()
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=30)  # uneven blocks: 15 per rank at P = 2, 8, 8, 7, 7 at P = 4
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})
    got = compiled(input_ids=ids, labels=labels, use_cache=False)
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    assert_close(f"rank {rank} loss", got.loss, want.loss)
    assert_close(f"rank {rank} logits", got.logits, want.logits)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_transformers_flex_llama_forward_equal_to_eager(world_size):
    run_ranks(flex_llama_equal_to_eager, world_size)


class FlexThenFlexWithLse(torch.nn.Module):
    """Two FlexAttention calls in one graph; the second's log-sum-exp is read, so that call runs whole on
    every rank while the first is split over heads."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(2))
        self.requires_grad_(False)

    def forward(self, x):
        b, s, d = x.shape
        for index, qkv in enumerate(self.qkv):
            q, k, v = qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            if index == 0:
                out = flex_attention(q, k, v)
            else:
                out, lse = flex_attention(q, k, v, return_lse=True)
                out = out * lse.unsqueeze(-1).sigmoid()
            x = x + out.transpose(1, 2).reshape(b, s, d)
        return x


def _features(seq: int = 30) -> torch.Tensor:
    return torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(3))


def test_a_flex_call_whose_log_sum_exp_is_read_runs_whole_beside_a_split_one(fake_group):
    fake_group(2)
    torch.manual_seed(0)
    (gm,) = rewritten_graphs(FlexThenFlexWithLse(), (_features(32),))
    report = gm.meta["ulysses_report"]
    assert [site.spelling for site in report.attention_sites] == ["flex_attention"]
    assert any("log-sum-exp" in reason for reason in report.rejected_attention), report.rejected_attention
    assert len(calls(gm, seq_to_heads_qkv)) == len(calls(gm, heads_to_seq)) == 1


def flex_with_lse_equal_to_eager(rank, world_size):
    torch.manual_seed(0)
    model = FlexThenFlexWithLse()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})
    assert_close(f"rank {rank} output", compiled(_features()), reference(_features()))


@pytest.mark.multirank
def test_a_flex_call_whose_log_sum_exp_is_read_equal_to_eager_at_two_ranks():
    run_ranks(flex_with_lse_equal_to_eager, 2)
