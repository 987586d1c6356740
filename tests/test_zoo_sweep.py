"""A bounded slice of the transformers zoo sweep (``tests/zoo_sweep.py``; its full run is a README
command): no architecture may be silently wrong or crash, and those listed must be parallel."""

import pytest

from zoo_sweep import sweep

# One of each attention form and family the sweep meets: SDPA with GQA, eager attention with casts, learned
# sinks, soft-capping, latent attention with MoE, an encoder-style LM head, merged-head ALiBi (rejected
# with a reason), a state-space model (no attention), a hybrid of both.
SLICE = ["llama", "gpt2", "gpt_oss", "gemma2", "deepseek_v3", "bert", "bloom", "mamba", "jamba", "qwen3_moe"]
PARALLEL = {"llama", "gpt2", "gemma2", "bert"}


@pytest.mark.slow
def test_zoo_slice_is_never_silently_wrong():
    rows = sweep([(model_type, "auto") for model_type in SLICE], world_size=2, report=lambda row: None)
    wrong = [row for row in rows if row.outcome in ("SILENT MISMATCH", "FAILS", "not built here")]
    assert not wrong, wrong
    assert {row.model_type for row in rows if row.outcome == "parallel, exact"} >= PARALLEL, rows
    assert all(row.parallel_sites == row.sites for row in rows if row.model_type != "bloom"), rows
    # each parallel site turns its query to heads and its output back, at least, by all-to-all
    assert all(row.all_to_alls >= 2 * row.sites for row in rows if row.parallel_sites), rows
