"""The token loss over the LM head runs in chunks of rows (``ulysses_compile/passes/tile_token_loss.py``,
``runtime.token_loss_sum``): the loss and every gradient equal eager's, in one chunk bit for bit, in
many within fp32's rounding; the pass replaces the model's ``cross_entropy`` at P = 2 and 4."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from graphs import reporting_backend
from models import VOCAB, tiny_llama, token_batch
from multirank import assert_close, compare_model, run_ranks

import ulysses_compile.core.runtime as runtime
from ulysses_compile.core.collectives import gather_parameter, sync_grad
from ulysses_compile.core.errors import UnsupportedError
from ulysses_compile.zero import compile_partitioned


def _rows(seed: int = 0, rows: int = 37, width: int = 16, vocab: int = 50):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), generator=generator)
    target[::3] = -100
    return hidden, weight, target


def _loss_and_grads(tiled: bool, hidden, weight, target, given_logits: bool = True):
    hidden.grad = weight.grad = None
    logits = F.linear(hidden, weight)
    if tiled:
        loss = runtime.token_loss_sum(logits if given_logits else None, hidden, weight, target, -100)
    else:
        loss = F.cross_entropy(logits.float(), target, ignore_index=-100, reduction="sum")
    (loss * 0.25).backward()
    assert logits.grad is None
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("given_logits", [True, False])
@pytest.mark.parametrize("rows_per_chunk", [None, 1, 5, 36])
def test_chunks_equal_eager_cross_entropy(monkeypatch, rows_per_chunk, given_logits):
    """None: one chunk, eager's kernels on eager's rows (bit for bit); else chunks of that many rows,
    the last one partial; the logits given, or computed chunk by chunk."""
    hidden, weight, target = _rows()
    want = _loss_and_grads(False, hidden, weight, target)
    if rows_per_chunk is not None:
        monkeypatch.setattr(runtime, "_CHUNK_ELEMENTS", rows_per_chunk * weight.shape[0])
    got = _loss_and_grads(True, hidden, weight, target, given_logits)
    for name, got_value, want_value in zip(("loss", "grad hidden", "grad weight"), got, want):
        if rows_per_chunk is None:  # the same aten kernels, operand layouts included, on the same rows as eager's
            assert torch.equal(got_value, want_value), name
        assert_close(name, got_value, want_value)


def tiled_in_the_model(rank, world_size, rows_per_chunk):
    model = tiny_llama(layers=2)
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=64)
    reports = []
    chunk_elements, runtime._CHUNK_ELEMENTS = runtime._CHUNK_ELEMENTS, rows_per_chunk * model.config.vocab_size
    try:
        got = torch.compile(model, backend=reporting_backend(reports))(input_ids=ids, labels=labels, use_cache=False)
        got.loss.backward()
    finally:
        runtime._CHUNK_ELEMENTS = chunk_elements
    (report,) = reports
    kinds = [collective.kind for collective in report.collectives]
    assert len(report.attention_sites) == 2 and not report.replicated
    assert kinds.count("seq_to_heads_qkv") == 2 and kinds.count("heads_to_seq") == 2, kinds
    assert "seq_to_heads" not in kinds and "gather_kv_heads" not in kinds, kinds
    assert [note for note in report.notes if "runtime.token_loss_sum" in note], report.notes
    assert "cross_entropy" not in report.graphs["tile_token_loss"]
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_model_loss_is_tiled_and_equals_eager(world_size):
    """A transformers Llama called with labels: its ``ForCausalLMLoss`` (upcast, shifted labels with
    ignored positions, mean) over each rank's 64 / P tokens in chunks of 5 rows."""
    run_ranks(tiled_in_the_model, world_size, 5)


def _scored(logits, labels):
    """A second loss from the logits outside the model (per-token log-probs, weighted)."""
    scores = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (scores * torch.linspace(0.5, 1.5, labels.shape[1])).sum()


def logits_computed_when_read(rank, world_size, zero_stage):
    model = tiny_llama(layers=2)
    if zero_stage:  # a vocabulary the shards do not split evenly: the last rank's is a padded copy
        model.resize_token_embeddings(VOCAB - 1)
    vocab = model.config.vocab_size
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=64)
    ids, labels = ids % vocab, labels.where(labels < 0, labels % vocab)
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports)) if not zero_stage else \
        compile_partitioned(model, reporting_backend(reports), zero_stage=zero_stage, group=None, mesh=None,
                            param_dtype=None, reduce_dtype=None, options={})
    got = compiled(input_ids=ids, labels=labels, use_cache=False)
    (report,) = reports
    kinds = [collective.kind for collective in report.collectives]
    assert len(report.attention_sites) == 2 and kinds.count("seq_to_heads_qkv") == 2, kinds
    assert kinds.count("heads_to_seq") == 2 and "seq_to_heads" not in kinds, kinds
    assert {position: (lazy.weight, lazy.vocab) for position, lazy in report.computed_outputs.items()} == {1: (2, vocab)}
    # the graph returns the weight's input (the parameter, or its ZeRO shard), not a [V, H] value that
    # would take a [V, H] gradient; the caller makes the weight from it when the logits are read
    steps = report.computed_outputs[1].chain.steps
    made_by = [gather_parameter] if zero_stage else [sync_grad]
    assert [(op, target) for op, target, _, _ in steps] == [("call_function", fn) for fn in made_by], steps
    returned = report.graphs["return_weight_inputs"].strip().splitlines()[-1]
    assert re.search(r"_modules_lm_head_(parameters_weight|dict_ulysses_shards_weight)_\)$", returned), returned
    assert [note for note in report.notes if "is computed from" in note and "when read" in note], report.notes
    linears = [report.graphs[name].count("torch._C._nn.linear(") for name in ("redistribute", "tile_token_loss")]
    assert linears[0] - linears[1] == 1, linears  # the LM head's
    total = got.loss + _scored(got.logits, labels)
    total.backward()
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    (want.loss + _scored(want.logits, labels)).backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits),
                                           "loss + scored logits": (total, want.loss + _scored(want.logits, labels))})
    later = compiled(input_ids=ids, labels=labels, use_cache=False)
    later.loss.backward()
    torch.optim.SGD(compiled.parameters(), lr=0.1).step()
    with pytest.raises(UnsupportedError, match=r"was written since the model ran \(optimizer.step\(\)\); read the "
                                               r"logits before the optimizer step"):
        later.logits.sum()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, zero_stage", [(2, 0), (4, 0), (2, 3)])
def test_logits_a_tiled_loss_leaves_out_are_computed_when_read_and_equal_eager(world_size, zero_stage):
    """Called with labels, the model's graph neither computes nor keeps the ``[S/P, V]`` logits: they
    are computed from the hidden states when read, equal eager's, and a second loss from them sends
    eager's gradients through the LM head; read after an optimizer step they would be the new
    weight's, so that read is refused with what to do, on every rank alike (under ZeRO-3 one rank's
    padded shard is a copy the step does not write)."""
    run_ranks(logits_computed_when_read, world_size, zero_stage)
