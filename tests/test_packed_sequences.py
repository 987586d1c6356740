"""Padding-free packed batches, as transformers' ``DataCollatorWithFlattening`` builds them: documents
of different lengths concatenated into one row, position ids restarting at each document, and for
flash-attn the documents' offsets (``cu_seq_lens_q/k``) passed to ``flash_attn_varlen_func``. Each
attention runs sequence-parallel (after the all-to-all every rank holds the whole packed row for its
heads, so the global offsets apply unchanged), and the loss, logits and every gradient equal eager's.
Document boundaries (13, 43, 50) fall inside the ranks' blocks."""

from __future__ import annotations

import copy

import pytest
import torch

from graphs import reporting_backend
from models import VOCAB, tiny_llama
from multirank import compare_model, run_ranks

pytestmark = pytest.mark.multirank

LAYERS = 2
DOCUMENT_LENGTHS = (13, 30, 7, 13)  # 63 positions: uneven blocks at P = 2 and 4


def _packed_batch(offsets: bool) -> dict:
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in DOCUMENT_LENGTHS]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=offsets, return_position_ids=True)
    return collator([{"input_ids": ids, "labels": ids} for ids in documents])


def packed_batch_is_parallel_and_exact(rank, world_size, attention):
    if attention == "flash_attention_2":
        from flash_attn_stand_in import transformers_uses_flash_attn

        transformers_uses_flash_attn()
    batch = _packed_batch(offsets=attention == "flash_attention_2")
    assert batch["input_ids"].shape == (1, sum(DOCUMENT_LENGTHS)) and batch["position_ids"][0, 13] == 0
    model = tiny_llama(layers=LAYERS)
    model.config._attn_implementation = attention
    reference = copy.deepcopy(model)
    reports = []
    backend = reporting_backend(reports)

    got = torch.compile(model, backend=backend)(**batch, use_cache=False)
    got.loss.backward()
    want = reference(**batch, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})
    (report,) = reports
    assert len(report.attention_sites) == LAYERS and not report.replicated, str(report)
    kinds = [c.kind for c in report.collectives]
    assert kinds.count("seq_to_heads_qkv") == LAYERS and kinds.count("heads_to_seq") == LAYERS, kinds
    assert "seq_to_heads" not in kinds and "gather_kv_heads" not in kinds, kinds
    if attention == "flash_attention_2":
        assert all(site.spelling == "flash_attn_varlen" and "packed sequences (cu_seqlens [5])" in site.summary()
                   for site in report.attention_sites), str(report)


# At 2 ranks the SDPA and flash cases are in the slow tier: the same code at 4 ranks is in the default one.
CASES = [pytest.param(2, "sdpa", id="P2-sdpa", marks=pytest.mark.slow), pytest.param(4, "sdpa", id="P4-sdpa"),
         pytest.param(2, "eager", id="P2-eager"),
         pytest.param(2, "flash_attention_2", id="P2-flash_attention_2"),
         pytest.param(4, "flash_attention_2", id="P4-flash_attention_2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("world_size,attention", CASES)
def test_packed_batch_is_parallel_and_exact(world_size, attention):
    run_ranks(packed_batch_is_parallel_and_exact, world_size, attention)
