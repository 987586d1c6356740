"""``SequenceParallelTrainer`` under torchrun (``examples/hf_trainer.py`` at a tiny size) against
transformers' own ``Trainer`` in one process on the same data: P ranks with gradient accumulation 1
equal one process with accumulation P over two epochs (every logged loss and gradient norm, the
evaluation and prediction losses, every saved weight after AdamW steps with warm-up, a cosine schedule
and clipping), and each rank's report shows the attention parallelized. Mixed precision is the
autocast one process runs (slow tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from multirank import assert_close, torchrun

EXAMPLE = Path(__file__).parents[1] / "examples" / "hf_trainer.py"
# 8 training windows: a step covers 4 (2 per rank, or 2 x 2 accumulated), so 3 steps span two epochs
TINY = ["--steps", "3", "--seq-len", "64", "--hidden", "64", "--compiler", "aot_eager", "--train-samples", "8"]


def _run(out: Path, ranks: int, *arguments: str) -> dict:
    torchrun(EXAMPLE, ranks, *TINY, "--out", str(out), *arguments)
    return json.loads((out / "log.json").read_text())


def _assert_same_training(got: dict, want: dict, rtol: float) -> None:
    assert [entry["step"] for entry in got["train"]] == [1, 2, 3] and got["epochs"] == want["epochs"] > 1
    for mine, theirs in zip(got["train"], want["train"], strict=True):
        for key in ("loss", "grad_norm"):
            assert_close(f"step {theirs['step']} {key}", torch.tensor(mine[key]), torch.tensor(theirs[key]), rtol)
    for key in ("eval_loss", "test_loss"):
        assert_close(key, torch.tensor(got[key]), torch.tensor(want[key]), rtol)


def _trains_as_one_process(tmp_path: Path, ranks: int, *arguments: str) -> None:
    plain = _run(tmp_path / "plain", 1, "--plain", "--gradient-accumulation-steps", str(ranks))
    parallel = _run(tmp_path / "parallel", ranks, "--dump-dir", str(tmp_path / "dump"), *arguments)
    _assert_same_training(parallel, plain, rtol=1e-4)
    trained, reference = (load_file(tmp_path / run / "model.safetensors") for run in ("parallel", "plain"))
    assert sorted(trained) == sorted(reference)
    for name, tensor in reference.items():
        assert_close(f"saved {name}", trained[name], tensor)
    for rank in range(ranks):
        reports = [path.read_text() for path in (tmp_path / "dump" / f"rank{rank}").glob("*/report.txt")]
        assert reports and all("attention sites: 2" in text and "seq_to_heads_qkv x2" in text and "heads_to_seq x2" in text
                               and "seq_to_heads x" not in text for text in reports), reports


@pytest.mark.multirank
def test_trainer_on_two_ranks_trains_as_one_process(tmp_path):
    _trains_as_one_process(tmp_path, 2)


@pytest.mark.multirank
@pytest.mark.slow
def test_trainer_on_dp2_x_sp2_trains_as_one_process(tmp_path):
    _trains_as_one_process(tmp_path, 4, "--data-parallel", "2")


@pytest.mark.multirank
@pytest.mark.slow
def test_trainer_mixed_precision_is_the_one_process_autocast(tmp_path):
    """bf16: the two ranks train as one process under the same autocast: every step's loss is within
    bf16 rounding (3e-2) of the one-process bf16 run's, and the first step's (the same weights: the
    forward under autocast and nothing else yet) ten times closer to it than to fp32 training's, so
    autocast is on in the ranks (bf16 moves this tiny model's loss by about 7e-5). Later steps follow
    weights that bf16 gradients moved, compiled on one side and eager on the other, each by noise of that
    size."""
    plain = _run(tmp_path / "plain", 1, "--plain", "--gradient-accumulation-steps", "2", "--bf16")
    parallel = _run(tmp_path / "parallel", 2, "--bf16", "--zero-stage", "0")
    _assert_same_training(parallel, plain, rtol=3e-2)
    fp32 = _run(tmp_path / "fp32", 1, "--plain", "--gradient-accumulation-steps", "2")
    mine, bf16, full = (run["train"][0]["loss"] for run in (parallel, plain, fp32))
    assert 10 * abs(mine - bf16) < abs(mine - full), (mine, bf16, full)


def test_trainer_refuses_checkpoints_it_could_not_resume(tmp_path):
    from transformers import TrainingArguments

    from models import tiny_llama
    from ulysses_compile import OptionsError
    from ulysses_compile.hf_trainer import SequenceParallelTrainer

    arguments = TrainingArguments(output_dir=str(tmp_path), save_strategy="steps", report_to=[], use_cpu=True)
    with pytest.raises(OptionsError, match="save_only_model=True"):
        SequenceParallelTrainer(model=tiny_llama(layers=1), args=arguments)
