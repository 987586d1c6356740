"""Sequence-sharded outputs leave the compiled model sharded. By default (``outputs="lazy"``) as tensors
that read as eager's and are gathered the first time they are read, so a loop that trains on ``.loss``
never gathers the logits; with ``outputs="dtensor"`` as DTensors, whole on request (``full_tensor``).
Both exact against eager; the outputs that cannot leave sharded are gathered, with the reason in the
report."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import nanogpt
from graphs import reporting_backend, rewritten_graphs
from models import VOCAB, tiny_llama, token_batch
from multirank import assert_close, compare_model, run_ranks
from sequence_models import graph_break_gpt
from zero_memory import collectives_by_kind

from ulysses_compile.core.boundary import GatheredOnUse, SequenceBlocks
from ulysses_compile.core.compat import BackendCompilerFailed
from ulysses_compile.core.errors import CollectiveError, UnsupportedError

DTENSORS = {"outputs": "dtensor"}


def _parallelized(report, layers: int) -> None:
    """Every attention site split, with its all-to-alls (q, k and v in one), and nothing gathered."""
    kinds = [collective.kind for collective in report.collectives]
    assert len(report.attention_sites) == layers and not report.replicated
    assert kinds.count("seq_to_heads_qkv") == layers and kinds.count("heads_to_seq") == layers, kinds
    assert "seq_to_heads" not in kinds and "gather_kv_heads" not in kinds, kinds
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


def test_outputs_that_cannot_leave_sharded_are_gathered_with_the_reason(fake_group):
    fake_group(2)
    model, args, kwargs = nanogpt.make(seq_len=31)
    (gm,) = rewritten_graphs(model, args, kwargs, **DTENSORS)
    report = gm.meta["ulysses_report"]
    assert report.sharded_outputs == {} and len(report.gathered_outputs) == 1
    assert "P = 2 does not divide its 31 positions" in report.gathered_outputs[0]
    torch.compiler.reset()
    (gm,) = rewritten_graphs(model, args, kwargs)  # the default: sharded in uneven blocks of a known length
    assert gm.meta["ulysses_report"].sharded_outputs == {0: SequenceBlocks(1, 1, 1, 31)}
    torch.compiler.reset()
    model, args, kwargs = nanogpt.make(seq_len=32)
    (gm,) = rewritten_graphs(model, args, kwargs, outputs="gather")
    assert ['option outputs="gather"' in line for line in gm.meta["ulysses_report"].gathered_outputs] == [True]
    torch.compiler.reset()
    (gm,) = rewritten_graphs(model, args, kwargs, **DTENSORS)
    assert gm.meta["ulysses_report"].sharded_outputs == {0: SequenceBlocks(1, 1, 1, 32)}  # (logits, loss)


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
    report = gm.meta["ulysses_report"]
    assert report.sharded_outputs == {0: SequenceBlocks(1, 1, 1, 32)} and report.gathered_outputs == []


def test_a_dtensor_input_without_plain_tensors_to_meet_is_refused_with_what_to_do(fake_group):
    """(With a plain parameter in the graph, Dynamo refuses the mix before the backend sees it.)"""
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(2)
    mesh = init_device_mesh("cpu", (2,))
    hidden = DTensor.from_local(torch.randn(2, 8, 16), mesh, [Shard(1)], run_check=False)
    with pytest.raises(BackendCompilerFailed, match=r"input x is a DTensor placed \(Shard\(dim=1\),\).*x.full_tensor\(\)"):
        torch.compile(lambda x: x.softmax(-1) * 2, backend="ulysses")(hidden)


def lazy_logits(rank, world_size, seq):
    model = tiny_llama(layers=2)
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=seq)
    reports = []
    got = torch.compile(model, backend=reporting_backend(reports))(input_ids=ids, labels=labels, use_cache=False)
    (report,) = reports
    _parallelized(report, layers=2)
    logits = got.logits
    assert isinstance(logits, GatheredOnUse) and logits.shape == (2, seq, VOCAB), (type(logits), logits.shape)
    detached = logits.detach()
    got.loss.backward()
    assert not logits.gathered and not detached.gathered  # training on .loss never gathers the logits
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (logits, want.logits)})
    assert logits.gathered and detached.gathered and torch.equal(detached, logits)
    assert_close(f"rank {rank} logits.tolist()", torch.tensor(logits.tolist()), want.logits)
    assert repr(logits).startswith("tensor(") and torch.equal(copy.deepcopy(detached), detached)
    with pytest.raises(UnsupportedError, match=r"changing its shape or strides in place.*x.transpose\(1, 2\)"):
        detached.transpose_(1, 2)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, seq", [(2, 64), (4, 62)])
def test_logits_are_gathered_only_when_read_and_equal_eager(world_size, seq):
    """The default: every attention parallelized and nothing gathered in the graph; the logits leave as
    the rank's block (uneven at P = 4), untouched by a step on ``.loss``, eager's tensor once read."""
    run_ranks(lazy_logits, world_size, seq)


def _written_and_scored(logits, labels):
    """A loss outside the model that writes into the logits first, through a view and in place."""
    logits[:, 5] = 0.0
    logits.mul_(0.5)
    return (_token_log_probs(logits, labels) * torch.linspace(0.5, 1.5, labels.shape[1])).sum()


def lazy_logits_outside_the_model(rank, world_size):
    model = tiny_llama(layers=2)
    reference = copy.deepcopy(model)
    ids, _ = token_batch(seq=64)
    reports = []
    logits = torch.compile(model, backend=reporting_backend(reports))(input_ids=ids, use_cache=False).logits
    _parallelized(reports[0], layers=2)
    got = _written_and_scored(logits, ids.roll(-1, dims=1))
    got.backward()
    want = _written_and_scored(reference(input_ids=ids, use_cache=False).logits, ids.roll(-1, dims=1))
    want.backward()
    compare_model(rank, model, reference, {"loss from written logits": (got, want)})


@pytest.mark.multirank
def test_a_loss_from_written_lazy_logits_outside_the_model_equals_eager():
    """DPO, GRPO and distillation compute their loss from ``.logits``; here after writes through a view
    and in place, which land on the gathered tensor and its gradient as eager's do."""
    run_ranks(lazy_logits_outside_the_model, 2)


class _LogitsAndLogProbs(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        return logits, logits.log_softmax(-1)


def reads_in_different_orders(rank, world_size):
    ids, _ = token_batch(seq=32)
    reports = []
    outputs = torch.compile(_LogitsAndLogProbs(tiny_llama(layers=2)), backend=reporting_backend(reports))(ids)
    assert sorted(reports[0].sharded_outputs) == [0, 1], str(reports[0])
    with pytest.raises(CollectiveError, match=r"the ranks read different outputs: rank [01] read output [01] of call 1 of this graph"
                                              r".*same order \(not under `if rank == 0:`\)"):
        outputs[rank].sum()


@pytest.mark.multirank
def test_ranks_reading_different_outputs_stop_with_what_to_do():
    """Each first read gathers from every rank; ranks that read different outputs would mix them up."""
    run_ranks(reads_in_different_orders, 2)


def reads_after_one_rank_called_a_graph_alone(rank, world_size):
    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    ids, _ = token_batch(seq=32)
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports))
    doubled = torch.compile(lambda hidden: hidden * 2.0, backend="ulysses", options={"check_inputs": False})
    first = compiled(input_ids=ids, use_cache=False).logits
    both = doubled(first)  # a graph with no collectives but the first call's check of the programs
    if rank == 0:
        doubled(first)  # the graph's second call, on this rank alone: it runs no collective
    assert isinstance(both, GatheredOnUse) and not first.gathered, type(both)
    second = compiled(input_ids=ids, use_cache=False).logits
    want = reference(input_ids=ids, use_cache=False).logits
    assert_close(f"rank {rank} logits of the second call", second, want)  # each read names its graph's own call
    assert_close(f"rank {rank} doubled logits", both, want * 2.0)
    assert all(not report.replicated for report in reports), str(reports)


def reads_of_a_graph_and_its_no_grad_twin(rank, world_size):
    ids, _ = token_batch(seq=32)
    compiled = torch.compile(tiny_llama(layers=1), backend=reporting_backend([]))
    trained = compiled(input_ids=ids, use_cache=False).logits  # call 1 of the graph
    with torch.no_grad():
        evaluated = compiled(input_ids=ids, use_cache=False).logits  # call 1 of the one Dynamo compiles for no_grad
    with pytest.raises(CollectiveError, match=r"rank [01] read output 0 of call 1 of another graph \((no_)?grad\)"):
        (trained if rank == 0 else evaluated).sum()


def reads_named_by_graph(rank, world_size):
    reads_after_one_rank_called_a_graph_alone(rank, world_size)
    torch.compiler.reset()
    reads_of_a_graph_and_its_no_grad_twin(rank, world_size)


@pytest.mark.multirank
def test_reads_name_the_call_of_their_own_graph():
    """A read names the output by its graph (its program and grad mode) and that graph's call, so calls
    one rank made of another graph (one with no collective, made alone) do not make the ranks' later
    reads disagree, and the outputs of a graph and of its no_grad twin (same program) are told apart."""
    run_ranks(reads_named_by_graph, 2)


def regionally_compiled(rank, world_size, lengths):
    model = tiny_llama(layers=3)
    reference = copy.deepcopy(model)
    reports = []
    for layer in model.model.layers:
        layer.compile(backend=reporting_backend(reports))
    for seq in lengths:  # compiles for the first length, then (Dynamo's second try) for every length
        ids, labels = token_batch(seq=seq)
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    model.zero_grad()
    assert reports and all(len(report.attention_sites) == 1 for report in reports)
    for report in reports:
        kinds = [c.kind for c in report.collectives]
        assert [kinds.count(kind) for kind in ("seq_to_heads_qkv", "seq_to_heads", "heads_to_seq")] == [1, 0, 1], kinds
        assert "gather_seq" not in kinds, kinds
    assert all(report.sharded_outputs and not report.gathered_outputs for report in reports)
    assert all(not report.replicated for report in reports)

    def step():
        step.got = model(input_ids=ids, labels=labels, use_cache=False)
        step.got.loss.backward()

    called = collectives_by_kind(step)
    # the first layer's input (the embedding, eager) is sliced, its gradient gathered in the backward; the
    # last layer's output is gathered where the eager norm reads it (with the small check of which output)
    assert called["alltoall"] == 2 * 2 * len(model.model.layers), called
    assert called["allgather"] == 3, called
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (step.got.loss, want.loss), "logits": (step.got.logits, want.logits)})
    if world_size > 2:
        return
    # a layer's output the caller reads as well: the gradient the next layer hands back as blocks meets
    # the whole one of the read
    model.zero_grad()
    reference.zero_grad()
    got = model(input_ids=ids, labels=labels, use_cache=False, output_hidden_states=True)
    (got.loss + got.hidden_states[2].square().mean()).backward()
    want = reference(input_ids=ids, labels=labels, use_cache=False, output_hidden_states=True)
    (want.loss + want.hidden_states[2].square().mean()).backward()
    compare_model(rank, model, reference, {"hidden states": (got.hidden_states[2], want.hidden_states[2])})


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, lengths", [pytest.param(2, (64, 66), marks=pytest.mark.slow), (4, (62,))])
def test_regionally_compiled_layers_pass_each_other_their_blocks_equal_to_eager(world_size, lengths):
    """One compiled decoder layer per layer (torchtitan's and accelerate's regional compilation): each
    layer's hidden states leave sharded and the next layer's graph takes its block as it is, and its
    gradient goes back as blocks: the sequence is not gathered between layers, whatever their number,
    at a length the graphs were compiled for (62: uneven blocks) and in graphs compiled for every one."""
    run_ranks(regionally_compiled, world_size, lengths)


def test_the_compile_caller_is_told_from_code_that_reads_the_outputs_first():
    """``backend.returns_to_compile_caller``: a graph that ends at a return hands its outputs to the
    caller of the compiled function (or module); one that ends at a graph break hands them to the code
    after the break, and the graph of that code, resumed, returns to the caller again, unless the
    compiled function's own code continues after it."""
    from ulysses_compile.backend import returns_to_compile_caller

    seen = []

    def backend(gm, example_inputs):
        seen.append(returns_to_compile_caller(gm))
        return gm.forward

    def returned(x):
        return x * 2

    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    def calls_broken(x):
        return broken(x) * 5

    torch.compiler.reset()
    torch.compile(returned, backend=backend)(torch.ones(2))
    torch.compile(broken, backend=backend)(torch.ones(2))
    torch.compile(torch.nn.Linear(2, 2), backend=backend)(torch.ones(2))
    assert seen == [True, False, True, True]
    torch.compiler.reset()
    seen.clear()
    torch.compile(calls_broken, backend=backend)(torch.ones(2))
    assert seen == [False, False, True]  # the code after the break returns into the caller's ``* 5``
