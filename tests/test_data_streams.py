"""Per-rank data streams (a ``DistributedSampler`` per rank, as DDP, accelerate and HF Trainer feed
ranks) trained through :class:`SequenceParallelLoader`: optimizer steps over its micro-batches equal
DDP steps over the same batches, computed in one process; loaders that end at different draws raise
on every rank."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from models import VOCAB, tiny_llama
from multirank import assert_close, run_ranks
from ulysses_compile import RankMismatchError, SequenceParallelLoader, full_state_dict, parallelize

pytestmark = pytest.mark.multirank

SEQ, SAMPLES, BATCH, STEPS = 32, 16, 2, 2


def _dataset(samples: int = SAMPLES) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _rank_loader(dataset, rank: int, world_size: int) -> DataLoader:
    """What a data-parallel script gives each rank: its own shuffled share of the dataset."""
    return DataLoader(dataset, batch_size=BATCH,
                      sampler=DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=7))


def per_rank_streams_train_like_ddp(rank, world_size, stage, data_parallel, folder):
    """STEPS optimizer steps of a parallelized Llama fed through the adapter, against DDP computed in one
    process: each step's gradient is the mean of every rank's batch loss; each micro-batch's loss and
    every parameter after each step equal it. The report shows the attention parallelized."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = None
    if data_parallel > 1:
        mesh = init_device_mesh("cpu", (data_parallel, world_size // data_parallel), mesh_dim_names=("dp", "sp"))
    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    compiled = parallelize(model, zero_stage=stage, mesh=mesh, compiler="aot_eager", dump_dir=folder)
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    dataset = _dataset()
    loader = SequenceParallelLoader(_rank_loader(dataset, rank, world_size), mesh=mesh)
    sequence_ranks = world_size // data_parallel
    assert loader.accumulation_steps == sequence_ranks and len(loader) == SAMPLES // BATCH // data_parallel
    ddp_batches = list(zip(*(_rank_loader(dataset, r, world_size) for r in range(world_size))))
    replica = 0 if mesh is None else mesh.get_local_rank("dp")
    where = f"rank {rank} P={world_size} stage {stage} dp={data_parallel}"
    micro = iter(loader)
    for step in range(STEPS):
        batches = ddp_batches[step]
        mine = batches[replica * sequence_ranks:(replica + 1) * sequence_ranks]
        for index, want in enumerate(mine):
            batch = next(micro)
            assert torch.equal(batch["input_ids"], want["input_ids"]), f"{where}: micro-batch {index} of step {step}"
            loss = compiled(**batch, use_cache=False).loss
            (loss / loader.accumulation_steps).backward()
            assert_close(f"{where} step {step} micro-batch {index} loss", loss,
                         reference(**want, use_cache=False).loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        (sum(reference(**b, use_cache=False).loss for b in batches) / world_size).backward()
        reference_optimizer.step()
        trained = full_state_dict(compiled)
        for name, tensor in reference.state_dict().items():
            assert_close(f"{where} {name} after step {step}", trained[name], tensor)
    (report,) = pathlib.Path(folder, f"rank{rank}").glob("*/report.txt")
    text = report.read_text()
    assert "attention sites: 1" in text and "seq_to_heads_qkv x1" in text and "heads_to_seq x1" in text, text
    assert "seq_to_heads x" not in text, text


CASES = [(2, 0, 1), (4, 3, 2), (4, 2, 1)]


@pytest.mark.parametrize("world_size,stage,data_parallel", CASES, ids=[f"P{p}-stage{s}-dp{d}" for p, s, d in CASES])
def test_per_rank_streams_train_like_ddp(world_size, stage, data_parallel, tmp_path):
    run_ranks(per_rank_streams_train_like_ddp, world_size, stage, data_parallel, str(tmp_path))


def epochs_reshuffle_and_end_together(rank, world_size):
    """Full passes over two epochs (``set_epoch`` reaching the DistributedSampler): the group's batches in
    rank order, draw by draw, every rank ending at the same draw; batches a tokenizer's collator builds
    (``BatchEncoding``) arrive as dicts."""
    from torch.utils.data import default_collate
    from transformers import BatchEncoding

    dataset = _dataset()
    loader = SequenceParallelLoader(DataLoader(dataset, batch_size=BATCH, collate_fn=lambda s: BatchEncoding(
        default_collate(s)), sampler=DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=7)))
    passes = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        got = [batch["input_ids"] for batch in loader]
        streams = [_rank_loader(dataset, r, world_size) for r in range(world_size)]
        for stream in streams:
            stream.sampler.set_epoch(epoch)
        want = [batch["input_ids"] for draw in zip(*streams) for batch in draw]
        assert len(got) == len(want) == len(loader)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"rank {rank} epoch {epoch}"
        passes.append(torch.stack(got))
    assert not torch.equal(*passes), "the second epoch repeated the first one's order"


def test_epochs_reshuffle_and_end_together():
    run_ranks(epochs_reshuffle_and_end_together, 2)


def ragged_loaders_raise_on_every_rank(rank, world_size):
    loader = SequenceParallelLoader(_rank_loader(_dataset(SAMPLES + 2 * BATCH * rank), 0, 1))
    with pytest.raises(RankMismatchError, match=r"ranks \[0\] ended after 8 batch"):
        list(loader)


def test_ragged_loaders_raise_on_every_rank():
    run_ranks(ragged_loaders_raise_on_every_rank, 2)
