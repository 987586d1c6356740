"""The gated MLP runs in chunks of rows (``ulysses_compile/passes/tile_mlp.py``, ``runtime.tiled_gated_mlp``): outputs
and every gradient equal eager's; by default in checkpointed layers, every MLP with ``tile_mlp=True``,
none with ``False``; inside the parallelized program at P = 2 and 4."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from graphs import reporting_backend
from models import tiny_llama, token_batch
from multirank import assert_close, compare_model, run_ranks

import ulysses_compile.core.runtime as runtime
from ulysses_compile.core.compat import ulysses_tracing

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("rows", [5, 16, 37])
def test_chunks_equal_eager_mlp(activation, rows):
    """16 rows of width 16: one chunk; 37: three, the last partial."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, rows, 16, generator=generator, requires_grad=True)
    weights = [torch.randn(shape, generator=generator, requires_grad=True) for shape in ((40, 16), (40, 16), (16, 40))]
    gate, up, down = weights
    want = F.linear(ACTIVATIONS[activation](F.linear(x, gate)) * F.linear(x, up), down)
    got = runtime.tiled_gated_mlp(x, gate, up, down, activation)
    assert_close("output", got, want)  # chunked matmuls round as the CPU's BLAS kernel chooses
    grad = torch.randn(want.shape, generator=generator)
    for name, got_grad, want_grad in zip(("x", "gate", "up", "down"), torch.autograd.grad(got, [x, *weights], grad),
                                         torch.autograd.grad(want, [x, *weights], grad)):
        assert_close(f"grad {name}", got_grad, want_grad)


def mlp_tiled_in_the_model(rank, world_size, checkpointing, tile_mlp):
    model = tiny_llama(layers=2)  # hidden 64: chunks of 64 rows
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=96)  # 2 x 96 / P rows: several chunks, the last partial at P = 4
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports, tile_mlp=tile_mlp))
    with ulysses_tracing():  # transformers 5.25's checkpointed layers: docs/limits.md
        got = compiled(input_ids=ids, labels=labels, use_cache=False)
    got.loss.backward()
    (report,) = reports
    kinds = [collective.kind for collective in report.collectives]
    assert len(report.attention_sites) == 2 and not report.replicated
    assert kinds.count("seq_to_heads_qkv") == 2 and kinds.count("heads_to_seq") == 2, kinds
    tiled = [note for note in report.notes if "runtime.tiled_gated_mlp" in note]
    expected = 2 if tile_mlp is True or (tile_mlp == "checkpointed" and checkpointing) else 0
    assert len(tiled) == expected, report.notes
    assert report.graphs["tile_mlp"].count("tiled_gated_mlp(") == expected
    want = reference(input_ids=ids, labels=labels, use_cache=False)
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, checkpointing, tile_mlp", [
    (2, True, "checkpointed"), (4, True, "checkpointed"), (2, False, True),
    pytest.param(2, False, "checkpointed", marks=pytest.mark.slow), pytest.param(2, True, False, marks=pytest.mark.slow),
])
def test_the_model_mlp_is_tiled_where_asked_and_equals_eager(world_size, checkpointing, tile_mlp):
    """A transformers Llama with gradient checkpointing (its MLPs tiled by default) or without (tiled
    only when asked), trained one step: loss, logits and every gradient equal eager's."""
    run_ranks(mlp_tiled_in_the_model, world_size, checkpointing, tile_mlp)
