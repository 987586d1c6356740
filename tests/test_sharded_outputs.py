"""With ``outputs="dtensor"``, sequence-sharded outputs leave the compiled model as DTensors: whole on
request (``full_tensor``) and exact against eager, never gathered when nobody asks; the outputs that
cannot be DTensors are gathered, with the reason in the report."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import nanogpt
from graphs import reporting_backend, rewritten_graphs
from models import VOCAB, tiny_llama, token_batch
from multirank import compare_model, run_ranks
from sequence_models import graph_break_gpt

from ulysses_compile.compat import BackendCompilerFailed

DTENSORS = {"outputs": "dtensor"}


def _parallelized(report, layers: int) -> None:
    """Every attention site split, with its all-to-alls, and nothing gathered."""
    kinds = [collective.kind for collective in report.collectives]
    assert len(report.attention_sites) == layers and not report.replicated
    assert kinds.count("seq_to_heads") == 3 * layers and kinds.count("heads_to_seq") == layers, kinds
    assert "gather_seq" not in kinds and report.gathered_outputs == [], (kinds, report.gathered_outputs)


def logits_leave_sharded(rank, world_size):
    model = tiny_llama(layers=2)
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=64)
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports, **DTENSORS))
    got = compiled(input_ids=ids, labels=labels, use_cache=False)
    (report,) = reports
    _parallelized(report, layers=2)
    logits = got.logits
    assert isinstance(logits, DTensor) and logits.placements == (Shard(1),), type(logits)
    assert logits.shape == (2, 64, VOCAB) and logits.to_local().shape == (2, 64 // world_size, VOCAB)
    assert logits.device_mesh.mesh_dim_names == ("sp",)
    assert dist.get_process_group_ranks(logits.device_mesh.get_group()) == list(range(world_size))
    got.loss.backward()
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (logits, want.logits)})


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_logits_leave_as_a_dtensor_equal_to_eager(world_size):
    run_ranks(logits_leave_sharded, world_size)


def _token_log_probs(logits, labels):
    """What DPO, GRPO and distillation losses start from: each token's log-probability of its label."""
    return logits.float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def log_probs_outside_the_model(rank, world_size):
    """A loss computed outside the model from ``.logits`` (no labels passed): per-token log-probs on the
    rank's tokens, only the [B, S] result gathered."""
    model = tiny_llama(layers=2)
    reference = copy.deepcopy(model)
    ids, _ = token_batch(seq=64)
    reports = []
    logits = torch.compile(model, backend=reporting_backend(reports, **DTENSORS))(input_ids=ids, use_cache=False).logits
    _parallelized(reports[0], layers=2)
    next_ids = distribute_tensor(ids.roll(-1, dims=1), logits.device_mesh, [Shard(1)])  # the last label unused
    per_token = _token_log_probs(logits, next_ids)
    assert per_token.placements == (Shard(1),) and per_token.to_local().shape == (2, 64 // world_size)
    got = per_token.full_tensor()[:, :-1]
    (got * torch.linspace(0.5, 1.5, 63)).sum().backward()
    want = _token_log_probs(reference(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:])
    (want * torch.linspace(0.5, 1.5, 63)).sum().backward()
    compare_model(rank, model, reference, {"per-token log-probs": (got, want)})


@pytest.mark.multirank
def test_per_token_log_probs_from_dtensor_logits_equal_eager():
    run_ranks(log_probs_outside_the_model, 2)


def test_outputs_that_cannot_be_dtensors_are_gathered_with_the_reason(fake_group):
    fake_group(2)
    model, args, kwargs = nanogpt.make(seq_len=31)
    (gm,) = rewritten_graphs(model, args, kwargs, **DTENSORS)
    report = gm.meta["ulysses_report"]
    assert report.sharded_outputs == {} and len(report.gathered_outputs) == 1
    assert "P = 2 does not divide its 31 positions" in report.gathered_outputs[0]
    torch.compiler.reset()
    model, args, kwargs = nanogpt.make(seq_len=32)
    (gm,) = rewritten_graphs(model, args, kwargs)  # the default: gathered
    assert ['option outputs="gather"' in line for line in gm.meta["ulysses_report"].gathered_outputs] == [True]
    torch.compiler.reset()
    (gm,) = rewritten_graphs(model, args, kwargs, **DTENSORS)
    assert gm.meta["ulysses_report"].sharded_outputs == {0: 1}  # nanogpt returns (logits, loss)


class _BreaksFirst(torch.nn.Module):
    """A model called after a graph break: Dynamo resumes in a function whose return the caller gets."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        torch._dynamo.graph_break()
        return self.model(idx, targets)


def test_values_crossing_a_graph_break_are_gathered_and_the_callers_are_not(fake_group):
    fake_group(2)
    model, args, kwargs = graph_break_gpt()
    reports = [gm.meta["ulysses_report"] for gm in rewritten_graphs(model, args, kwargs, **DTENSORS)]
    crossing = [line for report in reports for line in report.gathered_outputs]
    assert len(crossing) == 2 and all("crosses a graph break" in line for line in crossing), crossing
    assert [report.sharded_outputs for report in reports] == [{}, {}, {}]  # the last graph runs replicated
    torch.compiler.reset()
    model, args, kwargs = nanogpt.make(seq_len=32)
    (gm,) = rewritten_graphs(_BreaksFirst(model), args, kwargs, **DTENSORS)
    assert gm.meta["ulysses_report"].sharded_outputs == {0: 1} and gm.meta["ulysses_report"].gathered_outputs == []


def test_a_dtensor_input_without_plain_tensors_to_meet_is_refused_with_what_to_do(fake_group):
    """(With a plain parameter in the graph, Dynamo refuses the mix before the backend sees it.)"""
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(2)
    mesh = init_device_mesh("cpu", (2,))
    hidden = DTensor.from_local(torch.randn(2, 8, 16), mesh, [Shard(1)], run_check=False)
    with pytest.raises(BackendCompilerFailed, match=r"input x is a DTensor placed \(Shard\(dim=1\),\).*x.full_tensor\(\)"):
        torch.compile(lambda x: x.softmax(-1) * 2, backend="ulysses")(hidden)
