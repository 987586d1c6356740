"""``examples/real_scale.py`` (one rank's program of a real-size job on the fake process group) at a
small size on CPU, so the script a GPU run measures with is known to work before the GPU minutes, and
``explain``'s memory estimate is held to the step it measures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "real_scale.py"


@pytest.mark.slow
def test_real_scale_runs_small_on_cpu_as_explain_plans(tmp_path):
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, str(EXAMPLE), "--size", "small", "--world-size", "8", "--steps", "1",
                    "--out", str(out)], check=True, timeout=900)
    figures = json.loads(out.read_text())
    assert figures["tokens_per_rank"] == figures["seq_len"] // 8 == 512
    # the step's peak of live tensors (torch's profiler), parameters and AdamW state included, as
    # explain estimates it (docs/performance.md: a 350M Llama within the same bound)
    measured, estimated = figures["measured_peak_bytes"], figures["estimated_peak_bytes"]
    assert abs(estimated - measured) <= 0.1 * measured, (measured, estimated)
    # the rank holds its eighth (rows padded to equal blocks) of the fp32 parameters, gradients and state
    assert figures["whole_parameters"] / 8 <= figures["parameters"] < figures["whole_parameters"] / 7
    # AdamW: two moments per element and a 4-byte step count per parameter (a 2-layer Llama has 21)
    assert figures["gradients"] == figures["parameters"]
    assert figures["optimizer_state"] == 2 * figures["parameters"] + 4 * 21
    calls = figures["collectives_per_step"]

    def called(kind):
        return sum(count for name, count in calls.items() if kind in name)

    # 2 layers, each with one all-to-all to heads (q, k, v together) and one back, in the forward, in the
    # checkpointed layer's recompute and in the backward; ZeRO-3 gathers each layer's parameters at once
    # plus the embedding, the final norm and the LM head in the forward, and again in the backward
    # (the recompute reuses the backward's), and reduce-scatters the gradients; the input check gathers
    # each rank's place and fingerprints once
    assert (called("alltoall"), called("allgather"), called("reduce_scatter") > 0) == (2 * 3 * 2, 5 + 4 + 1, True), calls


@pytest.mark.slow
def test_gpu_check_runs_through_dry_on_cpu(tmp_path):
    """``scripts/gpu_check.sh --dry-run``: every step the GPU run takes, at the tiny size on CPU. The
    longest sequence it plans within 1 GiB is read off the sequence length's symbol, not another size's
    (the largest symbol was a parameter shard's: 536M tokens, every activation left at its traced size)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script), "--dry-run"], env={**os.environ, "PYTHON": sys.executable,
                          "OUT": str(tmp_path)}, check=True, timeout=900, capture_output=True, text=True)
    assert "ran on cpu: torch" in (tmp_path / "versions.txt").read_text(), done.stdout
    demo = (tmp_path / "demo.txt").read_text()
    assert re.search(r"^   0 +(\S+) +\1 ", demo, re.MULTILINE), demo  # at P = 1 the losses agree to the digit
    assert "3 tests collected" in (tmp_path / "gpu_tests.txt").read_text(), done.stdout
    assert json.loads((tmp_path / "real_scale.json").read_text())["tokens_per_rank"] == 128
    longest = re.search(r"the longest sequence that fits at P = 8 is ([\d,]+) tokens", (tmp_path / "longest.txt").read_text())
    # 64 hidden fp32 per token, a handful of them per layer held at the peak: a few million tokens in 1 GiB
    assert longest and 10**6 < int(longest.group(1).replace(",", "")) < 10**7, done.stdout
