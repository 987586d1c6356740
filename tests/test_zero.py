"""ZeRO-partitioned parameters with sequence parallelism: AdamW training against single-device eager,
step by step, and the errors for bad use."""

from __future__ import annotations

import copy

import pytest
import torch

from models import tiny_gpt2, tiny_llama, token_batch
from multirank import assert_close, run_ranks
from ulysses_compile import OptionsError, UlyssesError, full_state_dict, parallelize


def _train_against_eager(rank, model, stage, optimizer_class=torch.optim.AdamW, steps=3, **parallel):
    reference = copy.deepcopy(model)
    total = sum(p.numel() for p in model.parameters())
    compiled = parallelize(model, zero_stage=stage, options={"compiler": "aot_eager"}, **parallel)
    held = sum(p.numel() for p in compiled.parameters())
    optimizer = optimizer_class(compiled.parameters(), lr=1e-2)
    reference_optimizer = optimizer_class(reference.parameters(), lr=1e-2)
    for step in range(steps):
        ids, labels = token_batch(seq=32, seed=step + 1)
        for net, opt in ((compiled, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            loss = net(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step()
            if net is compiled:
                got = loss
        assert_close(f"rank {rank} stage {stage} step {step} loss", got, loss)
    full = full_state_dict(compiled)
    want = reference.state_dict()
    assert sorted(full) == sorted(want)
    for name, tensor in want.items():
        assert_close(f"rank {rank} stage {stage} {name} after {steps} steps", full[name], tensor)
    return held, total


def zero_stages_train_like_eager(rank, world_size):
    for stage in (1, 3):
        held, total = _train_against_eager(rank, tiny_llama(layers=1), stage)
        assert held <= total // world_size + 64  # one padded shard per parameter
    # Tied embedding and lm_head. SGD: GPT-2's key bias has a zero gradient (softmax ignores it), and
    # Adam divides its rounding noise by its own size, so parameters after Adam steps would compare noise.
    _train_against_eager(rank, tiny_gpt2(layers=1), 2, torch.optim.SGD)


@pytest.mark.multirank
def test_zero_stages_with_sequence_parallelism_train_like_eager():
    run_ranks(zero_stages_train_like_eager, 2)


def zero_on_a_data_by_sequence_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    replica = mesh.get_local_rank("dp")
    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    compiled = parallelize(model, zero_stage=3, mesh=mesh, options={"compiler": "aot_eager"})
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        batches = [token_batch(seq=32, seed=10 * step + seed) for seed in (1, 2)]  # one per replica
        optimizer.zero_grad()
        ids, labels = batches[replica]
        loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        eager_losses = [reference(input_ids=i, labels=l, use_cache=False).loss for i, l in batches]
        (sum(eager_losses) / 2).backward()  # DDP: the replicas' gradients averaged
        reference_optimizer.step()
        assert_close(f"rank {rank} replica loss step {step}", loss, eager_losses[replica])
    full = full_state_dict(compiled)
    for name, tensor in reference.state_dict().items():
        assert_close(f"rank {rank} {name} after 3 steps on the mesh", full[name], tensor)


def data_by_sequence_mesh_with_and_without_zero(rank, world_size):
    from test_sequences import data_times_sequence_mesh

    data_times_sequence_mesh(rank, world_size)
    zero_on_a_data_by_sequence_mesh(rank, world_size)


@pytest.mark.multirank
def test_data_by_sequence_mesh_with_and_without_zero_trains_like_ddp():
    """One spawn of 4 ranks for both (the suite's time): plain ulysses on the mesh, then ZeRO-3 on it."""
    run_ranks(data_by_sequence_mesh_with_and_without_zero, 4)


def test_parameters_are_gathered_inside_the_graph(fake_group):
    from test_structure import calls, rewritten_graphs
    from ulysses_compile.collectives import gather_parameter, seq_to_heads

    fake_group(2)
    model = tiny_llama(layers=1)
    total = sum(p.numel() for p in model.parameters())
    compiled = parallelize(model, zero_stage=3)
    shards = list(compiled.parameters())
    assert len(shards) == 12 and sum(p.numel() for p in shards) == total // 2
    ids, labels = token_batch(seq=32)
    (gm,) = rewritten_graphs(compiled._orig_mod, (), {"input_ids": ids, "labels": labels, "use_cache": False})
    assert len(calls(gm, gather_parameter)) == 12 and len(calls(gm, seq_to_heads)) == 3


def _gathers_in_backward(stage: int) -> int:
    """All-gathers AOTAutograd puts in the backward graph of a parallelized Llama (one process)."""
    from test_structure import rewritten_graphs
    from ulysses_compile.compat import aot_autograd, min_cut_rematerialization_partition

    model = tiny_llama(layers=1)
    ids, labels = token_batch(seq=32)
    kwargs = {"input_ids": ids, "labels": labels, "use_cache": False}
    (gm,) = rewritten_graphs(parallelize(model, zero_stage=stage)._orig_mod, (), kwargs)
    backward = []

    def keep_backward(graph, example_inputs):
        backward.append(graph)
        return graph

    torch._dynamo.reset()
    partitioned = aot_autograd(fw_compiler=lambda graph, inputs: graph, bw_compiler=keep_backward,
                               partition_fn=min_cut_rematerialization_partition)
    torch.compile(model, backend=lambda graph, inputs: partitioned(gm, inputs))(**kwargs).loss.backward()
    (graph,) = backward
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    return len(graph.graph.find_nodes(op="call_function", target=gather))


def test_stage_three_gathers_parameters_again_in_backward(fake_group):
    fake_group(2)
    assert _gathers_in_backward(1) == 0
    assert _gathers_in_backward(3) == 11  # every parameter but the embedding, whose backward needs only the ids


def test_bad_zero_use_gets_clear_errors(fake_group):
    fake_group(2)
    with pytest.raises(OptionsError, match="zero_stage=4"):
        parallelize(tiny_llama(layers=1), zero_stage=4)
    model = tiny_llama(layers=1)
    early = torch.optim.AdamW(model.parameters())
    parallelize(model, zero_stage=3)
    with pytest.raises(UlyssesError, match="already parallelized"):
        parallelize(model, zero_stage=3)
    with pytest.raises(UlyssesError, match="build the optimizer after parallelize"):
        early.step()
