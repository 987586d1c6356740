"""``explain``'s per-rank memory estimate of a training step: allocations counted until their last use,
parameters, gradients and optimizer state per ZeRO stage, one symbolic trace giving the estimate at
every length, and the CLI's answer to "the longest sequence that fits". Its error against measured
peaks is a benchmark (``examples/zero_memory.py``, docs/explain.md), not a test."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from models import tiny_llama, token_batch
from ulysses_compile import cli, explain
from ulysses_compile.backend import inner_compile
from ulysses_compile.core.memory import Timeline
from ulysses_compile.core.sharding import shard_rows

MIB = 2**20


def _step(x):
    doubled = x * 2  # 1 MiB
    doubled.mul_(3)  # in place: the same storage
    flat = doubled.view(-1)  # a view: nothing new
    shifted = flat + 1  # 1 MiB; doubled's storage is last used here
    return shifted.sum()


def test_the_timeline_counts_each_storage_once_until_its_last_use():
    x = torch.randn(256, 1024)  # 1 MiB, the caller's
    graph = make_fx(_step)(x).graph
    hints = {}
    timeline = Timeline.of(graph, set(graph.find_nodes(op="placeholder")), hints)
    assert hints == {}
    # doubled and shifted, never the input, the view or the in-place result again; the sum's 4 bytes
    # come after doubled is freed
    assert timeline.peak(timeline.sizes) == 2 * MIB
    assert sorted(timeline.sizes) == [4, MIB, MIB]


@functools.cache  # a trace is seconds; tests share them
def _figures(zero_stage: int, seq: int = 40, batch: int = 1, **options):
    ids, labels = token_batch(batch=batch, seq=seq)  # one sequence: the length is the one symbolic size
    return explain(tiny_llama(layers=1), input_ids=ids, labels=labels, world_size=2, zero_stage=zero_stage,
                   **options).memory


def _live_bytes(profile) -> list[int]:
    """The bytes allocated in ``profile`` and alive, after each allocation or free it recorded."""
    events = []

    def collect(event):
        if event.name == "[memory]":
            events.append((event.start_time_ns, event.typed[1].alloc_size))
        for child in event.children:
            collect(child)

    for root in profile.profiler.kineto_results.experimental_event_tree():
        collect(root)
    return list(itertools.accumulate(size for _, size in sorted(events)))


def test_the_aot_eager_backward_frees_each_saved_value_after_its_last_use():
    """As Inductor's code does and the estimate counts: a backward that held every saved value to its end
    (``make_boxed_func``) measured 1.2x the estimate in a checkpointed long-context step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    compiled = torch.compile(model, backend=lambda gm, inputs: inner_compile(gm, inputs, "aot_eager"))
    x = torch.randn(4096, 64)  # each saved value 1 MiB
    compiled(x).sum().backward()  # compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        compiled(x).sum().backward()
    live = _live_bytes(profile)
    at_last_gradient = live[max(index for index, (before, after) in enumerate(zip(live, live[1:]), 1)
                                if after > before)]
    assert max(live) >= 8 * MIB and at_last_gradient < 2 * MIB


def test_parameters_gradients_and_optimizer_state_follow_the_zero_stage():
    model = tiny_llama(layers=1)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = sum(shard_rows(p.shape[0], 2, 0)[1] * p[0].numel() * p.element_size() for p in model.parameters())
    unpartitioned, stage_one, stage_three = (_figures(stage) for stage in (0, 1, 3))
    assert (unpartitioned.parameters, unpartitioned.trainable) == (whole, whole)
    assert unpartitioned.at().optimizer_state == 2 * whole
    for memory in (stage_one, stage_three):
        figures = memory.at()
        assert figures.parameters == figures.gradients == shard and figures.optimizer_state == 2 * shard
    # stages 1-2 keep the gathered weights for the backward, stage 3 gathers them again
    assert stage_one.at().saved > stage_three.at().saved
    assert _figures(0, optimizer_states=1).at().optimizer_state == whole


def _close(symbolic, static) -> None:
    """A symbolic program's figures against a static one's at the same length: equal but for a few bytes,
    as the symbolic program holds the rank's number in its sizes where the static one reads the rank when
    it runs, and AOTAutograd saves a scalar or two differently for that."""
    assert {**vars(symbolic), "saved": 0, "peak": 0, "transient": 0, "largest_at_peak": 0, "peak_in": 0} == \
        {**vars(static), "saved": 0, "peak": 0, "transient": 0, "largest_at_peak": 0, "peak_in": 0}
    for figure in ("saved", "peak", "transient"):
        assert abs(getattr(symbolic, figure) - getattr(static, figure)) <= 64, (figure, symbolic, static)


def test_one_symbolic_trace_gives_the_estimate_of_every_length():
    symbolic = _figures(3, dynamic=True)
    ((symbol, traced),) = symbolic.hints.items()
    assert traced == 40
    _close(symbolic.at(), _figures(3).at())
    longer = symbolic.at({symbol: 96})
    _close(longer, _figures(3, seq=96).at())
    assert longer.saved > symbolic.at().saved and longer.peak > symbolic.at().peak


FACTORY = """
import torch
from models import tiny_llama, token_batch

def make(seq_len=32):
    with torch.device("meta"):
        model = tiny_llama(layers=1)
    ids, labels = token_batch(batch=1, seq=seq_len)
    return model, (), {"input_ids": ids.to("meta"), "labels": labels.to("meta")}
"""


def test_the_cli_answers_the_longest_sequence_that_fits(tmp_path, capsys):
    (tmp_path / "factory.py").write_text(FACTORY)
    limit = _figures(3, seq=96).at().peak + 64  # the symbolic program's few bytes more (_close)
    assert cli.main(["explain", f"{tmp_path}/factory.py:make", "-P", "2", "--zero-stage", "3", "--seq-len", "48",
                     "--max-memory", str(limit)]) == 0
    printed = capsys.readouterr().out
    assert "the longest sequence that fits at P = 2 is 96 tokens" in printed, printed
    assert "ZeRO stage 3" in printed and "largest transient" in printed


def test_the_cli_refuses_a_length_its_factory_cannot_take_and_a_size_it_cannot_read(tmp_path, capsys):
    (tmp_path / "fixed.py").write_text(FACTORY.replace("def make(seq_len=32):", "def make():\n    seq_len = 32"))
    assert cli.main(["explain", f"{tmp_path}/fixed.py:make", "-P", "2", "--seq-len", "64"]) == 2
    assert "the factory takes no seq_len argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["explain", f"{tmp_path}/fixed.py:make", "-P", "2", "--max-memory", "80 parsecs"])
    assert "expected a size such as 80GiB" in capsys.readouterr().err
    assert cli.parse_bytes("1.5GiB") == 3 * 2**29 and cli.parse_bytes("40GB") == 40 * 10**9
