"""``explain`` on a model built on the meta device: no weight or activation is allocated, nothing is
computed, and the report is the one real weights give. The causal mask transformers builds is proven
causal from its nodes, at any length, and a mask that is not the triangle is kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import tiny_llama, token_batch
from ulysses_compile import explain
from ulysses_compile.explain import FAKE_NOTE
from ulysses_compile.passes import recognize_causal_mask

UNPROVEN = "cannot prove the mask causal without computing it"


def _meta_llama(**config) -> nn.Module:
    with torch.device("meta"):
        return tiny_llama(**config)


def _sdpa_lines(code: str) -> list[str]:
    return [line for line in code.splitlines() if "scaled_dot_product_attention(" in line]


@pytest.mark.parametrize("world_size, use_cache", [(2, None), (4, False)])
def test_a_meta_llama_is_explained_as_with_real_weights(world_size, use_cache):
    seq, layers = 48, 1
    ids, labels = token_batch(seq=seq)
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    real = explain(tiny_llama(layers=layers), input_ids=ids, labels=labels, world_size=world_size, **kwargs)
    model = _meta_llama(layers=layers)
    meta = explain(model, input_ids=ids.to("meta"), labels=labels.to("meta"), world_size=world_size, **kwargs)

    assert str(meta) == str(real)
    assert all(parameter.is_meta and parameter.grad is None for parameter in model.parameters())
    assert [site.mask for site in meta.attention_sites] == ["causal"] * layers
    assert all(site.decision.startswith("parallelized") for site in meta.attention_sites)
    totals = meta.totals()
    # per layer and direction: q, k and v (or q alone, KV heads gathered) and the output
    assert totals[("forward", "all_to_all")][0] == totals[("backward", "all_to_all")][0] == 2 * layers, totals
    (graph,) = meta.graphs
    assert FAKE_NOTE in graph.notes and FAKE_NOTE not in real.graphs[0].notes
    assert not [note for note in graph.notes if UNPROVEN in note]
    # transformers' [B, 1, S, S] mask (built when there is no cache) is gone: every SDPA is causal
    assert (f"{seq}, {seq})" in graph.captured) == (use_cache is False)
    rewritten = graph.graphs["recognize_causal_mask"]
    assert f"{seq}, {seq})" not in rewritten
    assert all("is_causal = True" in line and "attn_mask = None" in line for line in _sdpa_lines(rewritten))


def test_a_mask_of_128k_positions_is_proven_causal_without_building_it(monkeypatch):
    def refuse(nodes, mask):
        raise AssertionError("the mask was computed")

    monkeypatch.setattr(recognize_causal_mask, "_compute", refuse)
    seq = 131072
    ids = torch.empty(1, seq, dtype=torch.long, device="meta")
    report = explain(_meta_llama(heads=4, kv_heads=2, layers=1), input_ids=ids, labels=ids, use_cache=False,
                     world_size=2)
    ((site,), (graph,)) = report.attention_sites, report.graphs
    assert site.mask == "causal" and site.seq_len == seq and site.decision.startswith("parallelized")
    assert f"{seq}, {seq})" in graph.captured and f"{seq}, {seq})" not in graph.graphs["recognize_causal_mask"]
    assert not [note for note in graph.notes if UNPROVEN in note]


class PositionMaskedAttention(nn.Module):
    """Self-attention under a boolean mask ``mask_of(q, k)`` of query and key positions, from aranges."""

    def __init__(self, mask_of, dim: int = 32, heads: int = 4):
        super().__init__()
        self.mask_of, self.heads, self.qkv = mask_of, heads, nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)
        mask = self.mask_of(positions[:, None], positions[None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


SEQ = 4096
MASKS = {  # name: (mask of query and key positions, whether it is the causal triangle at SEQ positions)
    "causal": (lambda q, k: k <= q, True),
    "causal, from the upper triangle": (lambda q, k: ~torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), True),
    "causal under a window wider than the sequence": (lambda q, k: (k <= q) & (q - k < 2 * SEQ), True),
    "sliding window": (lambda q, k: (k <= q) & (q - k < 4), False),
    "anti-causal": (lambda q, k: k >= q, False),
    "strictly below the diagonal": (lambda q, k: k < q, False),
    "causal, shifted by one": (lambda q, k: k + 1 <= q + 1, True),
    "one position ahead": (lambda q, k: k <= q + 1, False),
}


def _written_after(mask):
    mask[0, 1] = True  # the write is a node of its own: the mask's inputs do not lead to it
    return mask


def _written_position(q, k):
    shifted = q.clone()
    shifted.add_(1)
    return k <= shifted


WRITTEN_MASKS = {  # causal-looking masks written in place: never rewritten
    "causal, then one position set": lambda q, k: _written_after(k <= q),
    "causal, then filled by logical_or_": lambda q, k: (k <= q).logical_or_(torch.ones_like(k <= q)),
    "causal over positions shifted in place": _written_position,
}


@pytest.mark.parametrize("name", WRITTEN_MASKS)
def test_a_mask_written_in_place_is_kept(name):
    model = PositionMaskedAttention(WRITTEN_MASKS[name])
    report = explain(model, torch.randn(2, 16, 32), world_size=2)
    (site,) = report.attention_sites
    assert site.mask == "bool [16, 16]", site.mask


@pytest.mark.parametrize("name", MASKS)
def test_a_mask_is_rewritten_only_when_it_is_the_triangle(name):
    mask_of, causal = MASKS[name]
    with torch.device("meta"):
        model = PositionMaskedAttention(mask_of)
    report = explain(model, torch.empty(2, SEQ, 32, device="meta"), world_size=2)
    (site,) = report.attention_sites
    assert site.mask == ("causal" if causal else f"bool [{SEQ}, {SEQ}]")
    assert not [note for note in report.graphs[0].notes if UNPROVEN in note]  # decided by the proof


@pytest.mark.parametrize("name", ["causal", "causal under a window wider than the sequence"])
def test_a_mask_of_a_symbolic_length_is_proven_causal_for_every_length(name):
    x = torch.empty(2, 32, 32, device="meta")
    torch._dynamo.mark_dynamic(x, 1)
    with torch.device("meta"):
        model = PositionMaskedAttention(MASKS[name][0])
    report = explain(model, x, world_size=2)
    (site,) = report.attention_sites
    assert not isinstance(site.seq_len, int)
    unproven = [note for note in report.graphs[0].notes if UNPROVEN in note]
    if name == "causal":
        assert site.mask == "causal" and not unproven
    else:  # a window of 2 x 4096 positions is not wider than every length the graph serves: kept
        assert site.mask.startswith("bool") and len(unproven) == 1


def test_a_mask_the_proof_cannot_read_is_computed_when_small_and_else_kept_with_a_note():
    def flipped_twice(q, k):  # flip is not read as index algebra
        return k.flip(1).flip(1) <= q

    small = explain(PositionMaskedAttention(flipped_twice), torch.randn(2, 32, 32), world_size=2)
    assert small.attention_sites[0].mask == "causal"
    with torch.device("meta"):
        model = PositionMaskedAttention(flipped_twice)
    large = explain(model, torch.empty(2, SEQ, 32, device="meta"), world_size=2)
    assert large.attention_sites[0].mask == f"bool [{SEQ}, {SEQ}]"
    (note,) = [note for note in large.graphs[0].notes if UNPROVEN in note]
    assert "flip" in note


def test_a_checkpointed_meta_llama_is_explained_as_with_real_weights():
    """Gradient checkpointing: the backward replays each region's random-number state (SDPA draws
    numbers), a real generator state among the fake tensors."""
    ids, labels = token_batch(seq=32)

    def build():
        model = tiny_llama(layers=2)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    real = explain(build(), input_ids=ids, labels=labels, world_size=2, use_cache=False)
    with torch.device("meta"):
        model = build()
    meta = explain(model, input_ids=ids.to("meta"), labels=labels.to("meta"), world_size=2, use_cache=False)
    assert str(meta) == str(real)
    assert all(site.decision.endswith("in a checkpointed region (recomputed in the backward)")
               for site in meta.attention_sites) and len(meta.attention_sites) == 2
    assert meta.totals()[("backward", "all_to_all")][0] == 4 * 2  # recomputed forward all-to-alls, and the backward's


def test_a_meta_llama_generation_is_explained_as_with_real_weights():
    """``explain_generation`` of a model on the meta device: the prompt's and the decoding steps' plans,
    collectives and the KV cache per rank are those real weights give, and nothing is allocated."""
    from ulysses_compile import explain_generation

    ids, _ = token_batch(seq=32)
    real = explain_generation(tiny_llama(heads=8, kv_heads=4, layers=2), ids, world_size=4, new_tokens=2)
    model = _meta_llama(heads=8, kv_heads=4, layers=2)
    meta = explain_generation(model, ids.to("meta"), world_size=4, new_tokens=2)
    assert str(meta) == str(real)
    assert all(parameter.is_meta for parameter in model.parameters())
    assert meta.cache_bytes * 4 == meta.whole_cache_bytes > 0 and meta.cache_layout == "the rank's heads"
    assert all(FAKE_NOTE in graph.notes for graph in meta.prompt + meta.decoding)
    assert all(site.on_cache_heads for graph in meta.decoding for site in graph.attention_sites)
