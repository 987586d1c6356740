"""``examples/train.py`` end to end under torchrun, at a tiny size: two ranks train four steps with
checkpoints at steps 2 and 4; one process resumes from step 2 and trains steps 3 and 4 to the losses
the two ranks logged (the checkpoint resharded from 2 ranks to 1, and sequence parallelism equal to
one process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from multirank import RTOL, torchrun

pytestmark = pytest.mark.multirank

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"
TINY = ["--steps", "4", "--save-every", "2", "--seq-len", "64", "--hidden", "64", "--compiler", "aot_eager"]


def _torchrun(ranks: int, *arguments: str) -> None:
    torchrun(EXAMPLE, ranks, *TINY, *arguments)


def _losses(out: Path) -> dict[int, float]:
    rows = [line.split(",") for line in (out / "losses.csv").read_text().splitlines()]
    return {int(step): float(loss) for step, loss, _norm, _lr in rows}


def test_train_example_runs_saves_and_resumes_at_another_world_size(tmp_path):
    _torchrun(2, "--out", str(tmp_path / "two"))
    two = _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4] and two[4] < two[1]
    assert (tmp_path / "two" / "checkpoint-2").is_dir() and (tmp_path / "two" / "checkpoint-4").is_dir()
    _torchrun(1, "--out", str(tmp_path / "one"), "--resume-from", str(tmp_path / "two" / "checkpoint-2"))
    one = _losses(tmp_path / "one")
    assert sorted(one) == [3, 4]
    for step in (3, 4):
        assert abs(one[step] - two[step]) <= RTOL * abs(two[step]), (step, one[step], two[step])
