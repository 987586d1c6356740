"""A parallelized model inside the loop users write: nanoGPT's weight-decay groups, gradient clipping with
torch's ``clip_grad_norm_``, AdamW steps, and a Hugging Face checkpoint that ``from_pretrained`` loads on
one process; against the same loop on the unparallelized model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import nanogpt
from models import token_batch, tiny_llama
from multirank import assert_close, run_ranks
from ulysses_compile import full_state_dict, parallelize, save_pretrained

pytestmark = pytest.mark.multirank

MAX_NORM = 0.5  # below the models' gradient norms (about 1.5), so every step clips


def _whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _group_shapes(optimizer) -> list[list[tuple]]:
    return [[tuple(param.shape) for param in group["params"]] for group in optimizer.param_groups]


def clipped_training_equals_eager(rank, world_size, stage, data_parallel):
    """nanoGPT's configure_optimizers on the parallelized model gives the plain model's groups; three
    steps with clipping: loss, total norm and every clipped gradient equal eager's on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    model, _, _ = nanogpt.make(seq_len=32)
    reference = copy.deepcopy(model)
    mesh = None
    if data_parallel > 1:
        mesh = init_device_mesh("cpu", (data_parallel, world_size // data_parallel), mesh_dim_names=("dp", "sp"))
    compiled = parallelize(model, zero_stage=stage, mesh=mesh, compiler="aot_eager")
    replica = 0 if mesh is None else mesh.get_local_rank("dp")
    optimizer = compiled.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    reference_optimizer = reference.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    assert _group_shapes(optimizer) == _group_shapes(reference_optimizer)
    decay, no_decay = _group_shapes(optimizer)
    assert decay and no_decay and {len(shape) for shape in decay} == {2} and {len(shape) for shape in no_decay} == {1}
    where = f"rank {rank} P={world_size} stage {stage} dp={data_parallel}"
    for step in range(3):
        batches = [nanogpt.make(seq_len=32, seed=10 * step + seed)[1:] for seed in range(data_parallel)]
        (idx,), kwargs = batches[replica]
        optimizer.zero_grad()
        _, loss = compiled(idx, **kwargs)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(compiled.parameters(), MAX_NORM)
        reference_optimizer.zero_grad()
        eager_losses = [reference(idx, **kwargs)[1] for (idx,), kwargs in batches]
        (sum(eager_losses) / data_parallel).backward()
        eager_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        assert eager_norm > MAX_NORM
        assert_close(f"{where} step {step} loss", loss, eager_losses[replica])
        assert_close(f"{where} step {step} norm", _whole(norm), eager_norm)
        eager_grads = dict(reference.named_parameters())
        for name, param in compiled.named_parameters():
            want = eager_grads[name.removeprefix("_orig_mod.")].grad
            assert_close(f"{where} step {step} clipped grad {name}", _whole(param.grad), want)
        optimizer.step()
        reference_optimizer.step()


CASES = [(2, 1, 1), (2, 3, 1), (4, 3, 2), (4, 2, 1)]  # stages 1 and 2 differ only in what they keep


@pytest.mark.parametrize("world_size,stage,data_parallel", CASES,
                         ids=[f"P{p}-stage{s}-dp{d}" for p, s, d in CASES])
def test_clipping_and_weight_decay_groups_equal_eager(world_size, stage, data_parallel):
    run_ranks(clipped_training_equals_eager, world_size, stage, data_parallel)


def hugging_face_checkpoint_round_trip(rank, world_size, folder):
    """save_pretrained of a parallelized, trained Llama writes a checkpoint that from_pretrained loads on
    one process with every tensor equal to the trained one; rank 0 alone writes it. The parallelized
    model generates what the loaded one does."""
    from transformers import LlamaForCausalLM

    model = parallelize(tiny_llama(layers=1), zero_stage=3, compiler="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = token_batch(seq=32)
    model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    optimizer.step()
    trained = full_state_dict(model)
    save_pretrained(model, folder)
    loaded = LlamaForCausalLM.from_pretrained(folder)
    assert sorted(loaded.state_dict()) == sorted(trained)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), f"rank {rank}: {name} differs in the saved checkpoint"
    # generate() calls the model itself, eagerly, with a KV cache: the parameters are gathered there too
    prompt = ids[:, :8]
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False),
                       loaded.generate(prompt, max_new_tokens=4, do_sample=False))


def test_hugging_face_checkpoint_round_trip(tmp_path):
    run_ranks(hugging_face_checkpoint_round_trip, 2, str(tmp_path / "llama"))


def evaluation_is_sequence_parallel(rank, world_size):
    """``model.eval()`` under ``torch.no_grad()`` needs no switch: the evaluation graph is parallelized
    (a site per layer, its all-to-alls) and its loss and logits equal eager's. The model is set up for
    training as Trainer and PEFT leave it: checkpointed, with a hook that makes the embeddings' output
    require grad (an in-place ``requires_grad_`` in the graph under no_grad)."""
    from ulysses_compile.backend import ulysses

    model = tiny_llama(layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.eval()
    reports = []

    def backend(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options={"compiler": "aot_eager"})
        reports.append(gm.meta["ulysses_report"])
        return compiled

    ids, labels = token_batch(seq=64)
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(input_ids=ids, labels=labels, use_cache=False)
        want = model(input_ids=ids, labels=labels, use_cache=False)
    (report,) = reports
    assert len(report.attention_sites) == 2 and not report.replicated
    kinds = [c.kind for c in report.collectives]
    assert kinds.count("seq_to_heads_qkv") == 2 and kinds.count("heads_to_seq") == 2 and "seq_to_heads" not in kinds, kinds
    assert_close(f"rank {rank} eval loss", got.loss, want.loss)
    assert_close(f"rank {rank} eval logits", got.logits, want.logits)


def test_evaluation_is_sequence_parallel():
    run_ranks(evaluation_is_sequence_parallel, 2)
