"""FlexAttention as users reach it: transformers' ``attn_implementation="flex_attention"`` under
``torch.compile(model, backend="ulysses")`` as the README writes it. Forward only on CPU (FlexAttention
has no CPU backward; its gradients are checked on a GPU by tests/test_gpu.py); the hand-written
torchtitan-style form with a per-head block mask and a head-reading ``score_mod`` is in
tests/attention_forms.py."""

from __future__ import annotations

import copy

import pytest
import torch

from graphs import calls, rewritten_graphs
from models import tiny_llama, token_batch
from multirank import assert_close, run_ranks
from ulysses_compile.collectives import heads_to_seq, seq_to_heads_qkv


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
