"""The catalogue of bad inputs and faults (README, "Bad inputs and faults"): each one either raises an
error that names what and where and what to do, on every rank and within seconds, or gives eager's
results with a logged note. Faults: a rank that raises or dies mid-step leaves the others with an error
within the process group's timeout, not a hang. The cases already covered elsewhere (more ranks than
heads, ranks fed other shapes, unknown options, a mesh without "sp", ...) are listed in the README with
their tests."""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from attention_forms import LatentQueries
from models import tiny_llama, token_batch
from multirank import compare_model, free_port, run_ranks
from ulysses_compile import CollectiveError, OptionsError, RankMismatchError, UnsupportedError

EAGER = {"compiler": "eager"}
SHORT_TIMEOUT = datetime.timedelta(seconds=3)


def _raised(call) -> tuple[BaseException, float]:
    """The error ``call()`` raises (Dynamo's wrapper removed) and the seconds it took."""
    started = time.monotonic()
    try:
        call()
    except torch._dynamo.exc.BackendCompilerFailed as failure:
        return failure.inner_exception, time.monotonic() - started
    except Exception as error:  # noqa: BLE001 - the error is what the test checks
        return error, time.monotonic() - started
    raise AssertionError("no error was raised")


def _llama_call(options: dict, **inputs):
    model = torch.compile(tiny_llama(layers=1), backend="ulysses", options=options)
    return lambda: model(use_cache=False, **inputs)


def ranks_differ_in_dtype(rank, world_size):
    ids, _ = token_batch()
    error, seconds = _raised(_llama_call(EAGER, input_ids=ids.to(torch.int32 if rank == 1 else torch.int64)))
    assert isinstance(error, RankMismatchError), error
    assert "input_ids: rank 0 (2, 32) int64, rank 1 (2, 32) int32" in str(error) and seconds < 30


@pytest.mark.multirank
def test_ranks_passing_other_dtypes_get_a_rank_mismatch_error():
    run_ranks(ranks_differ_in_dtype, 2)


def ranks_differ_in_code(rank, world_size):
    ids, labels = token_batch()
    error, seconds = _raised(_llama_call(EAGER, input_ids=ids, **({"labels": labels} if rank == 1 else {})))
    assert isinstance(error, RankMismatchError), error
    assert "compiled different programs" in str(error) and "run the same code" in str(error) and seconds < 30


@pytest.mark.multirank
def test_ranks_running_other_graphs_get_a_rank_mismatch_error():
    run_ranks(ranks_differ_in_code, 2)


def rank_outside_its_group(rank, world_size):
    group = dist.new_group([0])
    ids, _ = token_batch()
    call = _llama_call({**EAGER, "group": group}, input_ids=ids)
    if rank == 0:  # a group of one: compiled as the inner compiler would
        call()
        return
    error, _ = _raised(call)
    assert isinstance(error, OptionsError), error
    assert "rank 1 of the default group) is not a member of the group" in str(error)


@pytest.mark.multirank
def test_a_group_the_rank_is_not_in_is_an_options_error():
    run_ranks(rank_outside_its_group, 2)


def inputs_on_another_device(rank, world_size):
    ids, _ = token_batch()  # an embedding lookup with indices on another device traces, so Dynamo lets it by
    error, _ = _raised(_llama_call(EAGER, input_ids=ids.to("meta")))
    assert isinstance(error, UnsupportedError), error
    assert "on 2 devices (meta: input_ids; cpu: model.embed_tokens.weight, model.rotary_emb.inv_freq" in str(error), str(error)
    assert "move the inputs to the parameters' device" in str(error)


@pytest.mark.multirank
def test_inputs_on_another_device_than_the_parameters():
    run_ranks(inputs_on_another_device, 2)


class TokenMLP(nn.Module):
    """No attention: nothing to split, so every rank computes the whole graph."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(128, 32)
        self.hidden = nn.Linear(32, 64)
        self.head = nn.Linear(64, 128)

    def forward(self, ids, labels):
        logits = self.head(F.gelu(self.hidden(self.embedding(ids))))
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


class FlatFeatures(nn.Module):
    """Features arrive flattened, ``[B, S * E]``: the sequence only appears after a ``view``."""

    def __init__(self, features: int = 8, heads: int = 4):
        super().__init__()
        self.features, self.heads = features, heads
        self.qkv = nn.Linear(features, 3 * features)
        self.out = nn.Linear(features, 1)

    def forward(self, flat, target):
        batch = flat.shape[0]
        tokens = flat.view(batch, -1, self.features)
        q, k, v = self.qkv(tokens).view(batch, -1, 3, self.heads, self.features // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        prediction = self.out(out.transpose(1, 2).flatten(2)).squeeze(-1)
        return prediction, F.mse_loss(prediction, target)


class PatchTransformer(nn.Module):
    """ViT-style: the sequence is made inside the model, from an image's patches (a strided convolution
    and a flatten of its two spatial dims); no input has a sequence dim."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.patches = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, images, labels):
        tokens = self.patches(images).flatten(2).transpose(1, 2)  # [B, N, dim]
        batch, length, dim = tokens.shape
        q, k, v = self.qkv(tokens).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        logits = self.head(out.transpose(1, 2).reshape(batch, length, dim).mean(1))
        return logits, F.cross_entropy(logits, labels)


def _unusual_model(name: str):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 30), generator=generator)
    if name == "no attention":
        return TokenMLP(), (ids, ids.roll(-1, 1))
    if name == "queries from a parameter":
        return LatentQueries(), (ids, torch.tensor([0, 2]))
    if name == "flat features":
        return FlatFeatures(), (torch.randn(2, 30 * 8, generator=generator), torch.randn(2, 30, generator=generator))
    return PatchTransformer(), (torch.randn(2, 3, 20, 24, generator=generator), torch.tensor([1, 4]))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def unusual_model_equals_eager(rank, world_size, name, note):
    from ulysses_compile.compiled_calls import _warn_once

    _warn_once.cache_clear()  # once per process, and the rank's process has served other tests
    model, args = _unusual_model(name)
    reference = copy.deepcopy(model)
    records, logger = _Records(), logging.getLogger("ulysses_compile")
    logger.addHandler(records)
    previous_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        out, loss = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})(*args)
    finally:
        logger.removeHandler(records)
        logger.setLevel(previous_level)
    loss.backward()
    want_out, want_loss = reference(*args)
    want_loss.backward()
    compare_model(rank, model, reference, {"output": (out, want_out), "loss": (loss, want_loss)})
    assert note is None or any(note in message for message in records.messages), records.messages
    unparallelized = [message for message in records.messages if "no attention parallelized" in message]
    assert len(unparallelized) == (rank == 0 and name == "no attention"), records.messages


UNUSUAL = [
    ("no attention", "no attention in this graph; it runs replicated on every rank"),
    ("queries from a parameter", None),  # parallelized: the latents and the tokens are each split
    ("flat features", "fallback mse_loss (mse_loss): no sharding rule for this op; gathered prediction"),
    ("image patches", None),  # the convolution runs whole, its 30 patches are split
]


@pytest.mark.multirank
@pytest.mark.parametrize("name,note", UNUSUAL, ids=[name for name, _ in UNUSUAL])
def test_models_without_a_splittable_sequence_equal_eager_with_a_note(name, note):
    run_ranks(unusual_model_equals_eager, 2, name, note)


def call_after_the_group_is_destroyed(rank, world_size):
    group = dist.new_group([0, 1])
    ids, _ = token_batch()
    call = _llama_call({**EAGER, "group": group}, input_ids=ids)
    call()
    dist.destroy_process_group(group)
    error, seconds = _raised(call)
    assert isinstance(error, CollectiveError), error
    assert "process group of 2 ranks that has been destroyed; call torch.compiler.reset()" in str(error)
    assert seconds < 30  # refused before any collective: no wait for a timeout


@pytest.mark.multirank
def test_calling_after_the_process_group_is_destroyed():
    run_ranks(call_after_the_group_is_destroyed, 2)


def rank_raises_mid_step(rank, world_size, phase):
    """Rank 1 raises between two steps (the others' forward waits) or between forward and backward."""
    group = dist.new_group([0, 1], timeout=SHORT_TIMEOUT)
    ids, labels = token_batch()
    model = torch.compile(tiny_llama(layers=1), backend="ulysses", options={"group": group, "compiler": "aot_eager"})
    model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    if rank == 1:
        if phase == "backward":
            model(input_ids=ids, labels=labels, use_cache=False)
        return  # this rank "raised": it leaves the step and joins no further collective
    if phase == "forward":
        error, seconds = _raised(lambda: model(input_ids=ids, labels=labels, use_cache=False))
        assert isinstance(error, CollectiveError), error
        assert "rank 0: a collective of compiled graph 0/0 over 2 sequence-parallel ranks did not complete" in str(error)
        assert "process group's timeout (0:00:03)" in str(error)
    else:
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        error, seconds = _raised(loss.backward)
        assert "Timed out waiting 3000ms" in str(error), error
    assert SHORT_TIMEOUT.total_seconds() <= seconds < SHORT_TIMEOUT.total_seconds() + 10, seconds


@pytest.mark.multirank
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_rank_that_raises_mid_step_leaves_the_others_an_error_within_the_timeout(phase):
    run_ranks(rank_raises_mid_step, 2, phase)


def ranks_at_different_calls(rank, world_size):
    """Rank 1 makes its second call under ``torch.no_grad()`` (Dynamo compiles another graph for it), rank
    0 with grad: each names every rank's place at once, before any collective of the two programs meets
    one of another size; a dtype changed on one rank after the first call likewise."""
    from ulysses_compile.agreement import _GRAPHS

    _GRAPHS.clear()  # (the graphs earlier tests called in this rank's process: one may be this no_grad one)
    ids, _ = token_batch()
    model = torch.compile(tiny_llama(layers=1), backend="ulysses", options=EAGER)
    model(input_ids=ids, use_cache=False)
    with torch.no_grad() if rank == 1 else contextlib.nullcontext():
        error, seconds = _raised(lambda: model(input_ids=ids, use_cache=False))
    assert isinstance(error, RankMismatchError), error
    other = "compiled graph 0/1" if rank == 1 else "a graph this rank has not called"
    assert (f"rank {rank}: the sequence-parallel ranks are not at the same call of the same compiled graph: rank 0 "
            f"at call 2 of compiled graph 0/0 (grad); rank 1 at call 1 of {other} (no_grad)") in str(error), error
    assert "a rank that calls the model once more" in str(error) and seconds < 30
    torch.compiler.reset()
    model = torch.compile(tiny_llama(layers=1), backend="ulysses", options=EAGER)
    model(input_ids=ids, use_cache=False)
    error, _ = _raised(lambda: model(input_ids=ids.to(torch.int32) if rank == 1 else ids, use_cache=False))
    assert isinstance(error, RankMismatchError) and "rank 0 at call 2 of compiled graph 0/0 (grad); rank 1 at " \
        "call 1 of" in str(error), error


@pytest.mark.multirank
def test_ranks_at_different_calls_are_named_at_once():
    run_ranks(ranks_at_different_calls, 2)


def rank_left_the_loop(rank, world_size):
    """Rank 1 stops calling the model (it left its loop; alive, in no collective): rank 0's next call
    says where it waits once ``rank_wait_warning`` has passed, and fails at the group's timeout."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=4))
    ids, _ = token_batch()
    call = _llama_call({**EAGER, "group": group, "rank_wait_warning": 1}, input_ids=ids)
    call()
    call()
    if rank == 1:
        return
    logged = []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("ulysses_compile").addHandler(handler)
    try:
        error, seconds = _raised(call)
    finally:
        logging.getLogger("ulysses_compile").removeHandler(handler)
    assert isinstance(error, CollectiveError) and "did not complete" in str(error), error
    assert [record.getMessage() for record in logged if "has waited" in record.getMessage()] == [
        "ulysses_compile: rank 0 has waited 1 s at call 3 of compiled graph 0/0 (grad) for the other "
        "sequence-parallel ranks: one of them is not calling the model (it left the loop, made fewer calls, "
        "waits in another collective) or is busy alone (a checkpoint one rank writes, a slow data loader). The "
        "wait ends at the process group's timeout (0:00:04)."], logged
    assert 4 <= seconds < 14, seconds


@pytest.mark.multirank
def test_a_rank_that_left_the_loop_is_reported_while_the_others_wait():
    run_ranks(rank_left_the_loop, 2)


def _killed_mid_step(rank, world_size, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    ids, labels = token_batch()
    model = torch.compile(tiny_llama(layers=1), backend="ulysses", options={"compiler": "aot_eager"})
    model(input_ids=ids, labels=labels, use_cache=False)
    if rank == 1:
        os.kill(os.getpid(), 9)
    error, seconds = _raised(lambda: model(input_ids=ids, labels=labels, use_cache=False))
    results.put((type(error).__name__, str(error), seconds))


@pytest.mark.multirank
def test_a_rank_killed_mid_step_leaves_the_others_an_error_in_seconds():
    """Killed, not raising: its sockets close, so the others' next collective fails at once (no timeout)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_killed_mid_step, args=(rank, 2, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        kind, message, seconds = results.get(timeout=300)
    finally:
        for process in processes:
            process.kill()
            process.join()
    assert kind == "CollectiveError", message
    assert "rank 0: a collective of compiled graph 0/0 over 2 sequence-parallel ranks did not complete" in message
    assert seconds < 10, seconds


def recompile_limit_reached(rank, world_size):
    """Every rank meets the same lengths, so every rank reaches the limit at the same call and runs
    that frame eagerly (Dynamo's fallback): the global batch computed whole, eager's results."""
    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ulysses", options=EAGER, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        for seq in (32, 24):
            ids, labels = token_batch(seq=seq)
            model.zero_grad()
            reference.zero_grad()
            got = compiled(input_ids=ids, labels=labels, use_cache=False)
            got.loss.backward()
            want = reference(input_ids=ids, labels=labels, use_cache=False)
            want.loss.backward()
            compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.multirank
def test_recompile_limit_reached_falls_back_to_eager_on_every_rank():
    run_ranks(recompile_limit_reached, 2)


class AttentionOnInputs(nn.Module):
    def forward(self, query, key, value):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True)


def test_symbolic_heads_are_an_unsupported_error(fake_group):
    """Marking the heads dim dynamic makes the head split a symbol; only the sequence may be dynamic."""
    fake_group(2)
    qkv = [torch.randn(2, 4, 16, 8) for _ in range(3)]
    for tensor in qkv:
        torch._dynamo.mark_dynamic(tensor, 1)
    error, _ = _raised(lambda: torch.compile(AttentionOnInputs(), backend="ulysses")(*qkv))
    assert isinstance(error, UnsupportedError), error
    assert "heads, key/value heads and head dim" in str(error) and "are symbolic" in str(error)
