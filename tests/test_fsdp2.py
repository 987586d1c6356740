"""FSDP2 (``fully_shard``) over every rank of a ``("dp", "sp")`` mesh, torchtitan's ``dp_shard_cp``
layout, with the model compiled by the ulysses backend on that mesh: one training step's loss and every
gradient equal eager's mean over the replicas' batches, and the attention runs on the rank's heads."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from graphs import reporting_backend
from models import tiny_llama, token_batch
from multirank import assert_close, run_ranks

pytestmark = pytest.mark.multirank


def fsdp2_step_equal_to_eager(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    model = tiny_llama(heads=4, kv_heads=2)
    reference = copy.deepcopy(model)
    every_rank = mesh["dp", "sp"]._flatten("dp_sp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=every_rank)
    fully_shard(model, mesh=every_rank)
    batches = [token_batch(seq=32, seed=seed) for seed in (1, 2)]
    ids, labels = batches[mesh.get_local_rank("dp")]
    reports = []
    compiled = torch.compile(model, backend=reporting_backend(reports, mesh=mesh))
    loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()

    # FSDP2's hooks break the graph around each layer: one decoder-layer graph serves both layers, its
    # attention on the rank's heads; the hidden states cross the breaks as the rank's block, never gathered
    layers = [report for report in reports if report.attention_sites]
    assert len(layers) == 1 and len(layers[0].attention_sites) == 1 and not layers[0].replicated, layers
    kinds = [collective.kind for collective in layers[0].collectives]
    assert kinds.count("seq_to_heads_qkv") == 1 and kinds.count("heads_to_seq") == 1, kinds
    assert not any(collective.kind == "gather_seq" for report in reports for collective in report.collectives)

    losses = [reference(input_ids=i, labels=l, use_cache=False).loss for i, l in batches]
    (sum(losses) / len(losses)).backward()
    assert_close(f"rank {rank} loss", loss.detach(), losses[mesh.get_local_rank("dp")].detach())
    eager = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert_close(f"rank {rank} grad {name}", parameter.grad.full_tensor(), eager[name].grad)


def test_fsdp2_over_the_data_and_sequence_ranks_trains_exactly():
    run_ranks(fsdp2_step_equal_to_eager, 4)
