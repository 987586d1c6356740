"""``examples/real_scale.py`` (one rank's program of a real-size job on the fake process group) at its
tiny size on CPU, so the script a GPU run measures with is known to work before the GPU minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "real_scale.py"


@pytest.mark.slow
def test_real_scale_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, str(EXAMPLE), "--world-size", "8", "--steps", "1", "--out", str(out)],
                   check=True, timeout=900)
    figures = json.loads(out.read_text())
    assert figures["tokens_per_rank"] == figures["seq_len"] // 8 == 128
    # the rank holds its eighth (rows padded to equal blocks) of the fp32 parameters, gradients and state
    assert figures["whole_parameters"] / 8 <= figures["parameters"] < figures["whole_parameters"] / 7
    # AdamW: two moments per element and a 4-byte step count per parameter (a tiny Llama has 21)
    assert figures["gradients"] == figures["parameters"]
    assert figures["optimizer_state"] == 2 * figures["parameters"] + 4 * 21
    calls = figures["collectives_per_step"]

    def called(kind):
        return sum(count for name, count in calls.items() if kind in name)

    # 2 layers, each with one all-to-all to heads (q, k, v together) and one back, in the forward, in the
    # checkpointed layer's recompute and in the backward; ZeRO-3 gathers each layer's parameters at once
    # plus the embedding, the final norm and the LM head in the forward, and again in the backward
    # (the recompute reuses the backward's), and reduce-scatters the gradients
    assert (called("alltoall"), called("allgather"), called("reduce_scatter") > 0) == (2 * 3 * 2, 5 + 4, True), calls
