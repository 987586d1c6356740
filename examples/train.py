"""A training script as people write them, made sequence-parallel by ``ulysses_compile.parallelize``.

    torchrun --nproc-per-node 2 examples/train.py                      # 2 ranks: sequence parallelism
    torchrun --nproc-per-node 4 examples/train.py --data-parallel 2    # 2 replicas x 2 sequence ranks
    torchrun --nproc-per-node 1 examples/train.py --resume-from train_out/checkpoint-10   # at another P

A transformers Llama learns the bytes of Python's own source (byte-level tokens, no download), with
gradient checkpointing on every layer, ZeRO-3 (``parallelize``), AdamW with weight decay for 2-D
parameters only, a warm-up and cosine learning-rate schedule, gradient clipping, a progress bar and a
loss log (``OUT/losses.csv``: step, loss, gradient norm, learning rate), and sharded checkpoints
(``torch.distributed.checkpoint``, ``OUT/checkpoint-STEP``) that resume at any number of ranks. Every rank of a sequence-parallel group reads the same batches: the sampler
is split by data-parallel replica, not by rank.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses_compile


class PythonSourceBytes(Dataset):
    """Fixed-length windows of the bytes of a few standard-library modules (a corpus every machine has)."""

    def __init__(self, seq_len: int):
        import argparse as corpus_a, dataclasses as corpus_b, inspect as corpus_c

        text = "".join(inspect.getsource(module) for module in (corpus_a, corpus_b, corpus_c)).encode()
        tokens = torch.tensor(list(text), dtype=torch.long)
        self.windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict:
        window = self.windows[index]
        return {"input_ids": window, "labels": window}  # the model shifts the labels


def build_model(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq_len)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def optimizer_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay for matrices and embeddings, none for norms and biases (nanoGPT's rule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel replica")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--data-parallel", type=int, default=1, help="replicas; the rest of the ranks share sequences")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--out", default="train_out")
    parser.add_argument("--resume-from", help="a checkpoint folder (OUT/checkpoint-STEP) to continue from")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh("cpu", (args.data_parallel, world // args.data_parallel), mesh_dim_names=("dp", "sp"))
    model = ulysses_compile.parallelize(build_model(args), zero_stage=3, mesh=mesh, compiler=args.compiler)
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, args.steps // 10), args.steps))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {"step": 0}
    if args.resume_from:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optimizer": optimizer_state, "schedule": schedule.state_dict(), **state}
        dcp.load(loaded, checkpoint_id=args.resume_from)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        schedule.load_state_dict(loaded["schedule"])
        state["step"] = loaded["step"]

    data = PythonSourceBytes(args.seq_len)
    sampler = DistributedSampler(data, num_replicas=args.data_parallel, rank=mesh.get_local_rank("dp"), seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    batches = _batches(loader, sampler, start=state["step"])

    log = open(out / "losses.csv", "a" if args.resume_from else "w") if rank == 0 else None
    progress = tqdm(range(state["step"], args.steps), initial=state["step"], total=args.steps, disable=rank != 0)
    for step in progress:
        batch = next(batches)
        optimizer.zero_grad()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # DTensor gradients give a DTensor
        optimizer.step()
        schedule.step()
        losses = [torch.zeros(()) for _ in range(args.data_parallel)]  # each replica's loss, for the log
        dist.all_gather(losses, loss.detach(), group=mesh.get_group("dp"))
        mean_loss = torch.stack(losses).mean().item()
        progress.set_postfix(loss=f"{mean_loss:.4f}", norm=f"{norm.item():.3f}")
        if log:
            log.write(f"{step + 1},{mean_loss:.6f},{norm.item():.6f},{schedule.get_last_lr()[0]:.6g}\n")
            log.flush()
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state, "schedule": schedule.state_dict(),
                      "step": step + 1}, checkpoint_id=out / f"checkpoint-{step + 1}")
    dist.destroy_process_group()


def _batches(loader, sampler, start: int):
    """The loader's batches forever, epoch after epoch, from global step ``start`` on."""
    epoch, step = 0, 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step >= start:
                yield batch
            step += 1
        epoch += 1


if __name__ == "__main__":
    main()
