"""Train a small, unmodified transformers Llama with Ulysses sequence parallelism on P CPU ranks (or GPUs).

    python examples/demo.py                 # P = 2 gloo ranks, 5 AdamW steps, Inductor
    python examples/demo.py --world-size 4 --steps 3 --compiler aot_eager
    python examples/demo.py --world-size 1 --device cuda   # one rank per GPU (NCCL)

Every rank builds the same model and passes the same global batch; ``torch.compile(model,
backend="ulysses")`` shards the sequence over the ranks. Rank 0 also trains an eager single-device copy
on the same batches and prints both losses per step, and, each step, the largest gradient error
against eager gradients computed from the very same parameters (relative to each gradient's magnitude).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config)


def batch(step: int, seq_len: int, device: torch.device) -> dict:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 256, (2, seq_len), generator=generator)
    labels = ids.clone()
    labels[:, : seq_len // 8] = -100  # e.g. a prompt that is not trained on
    return {"input_ids": ids.to(device), "labels": labels.to(device), "use_cache": False}


def max_relative_grad_error(model, checker, inputs) -> float:
    checker.load_state_dict(model.state_dict())
    checker.zero_grad()
    checker(**inputs).loss.backward()
    worst = 0.0
    reference_params = dict(checker.named_parameters())
    for name, param in model.named_parameters():
        want = reference_params[name].grad
        error = (param.grad - want).abs().max().item()
        worst = max(worst, error / max(want.abs().max().item(), 1e-12))
    return worst


def train(rank: int, world_size: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world_size)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = build_model().to(device)
    reference = copy.deepcopy(model) if rank == 0 else None
    checker = copy.deepcopy(model) if rank == 0 else None
    compiled = torch.compile(model, backend="ulysses", options={"compiler": args.compiler})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3) if reference is not None else None
    if rank == 0:
        print(f"{world_size} ranks, sequence {args.seq_len} ({args.seq_len // world_size} tokens per rank), "
              f"compiler {args.compiler}")
        print(f"{'step':>4}  {'ulysses loss':>12}  {'eager loss':>12}  {'|difference|':>12}  {'max grad error':>14}"
              f"  {'seconds':>7}")
    for step in range(args.steps):
        started = time.perf_counter()
        inputs = batch(step, args.seq_len, device)
        optimizer.zero_grad()
        loss = compiled(**inputs).loss
        loss.backward()
        if rank == 0:
            reference_optimizer.zero_grad()
            reference_loss = reference(**inputs).loss
            reference_loss.backward()
            grad_error = max_relative_grad_error(model, checker, inputs)
            reference_optimizer.step()
        optimizer.step()
        if rank == 0:
            print(f"{step:>4}  {loss.item():>12.6f}  {reference_loss.item():>12.6f}  "
                  f"{abs(loss.item() - reference_loss.item()):>12.2e}  {grad_error:>14.2e}"
                  f"  {time.perf_counter() - started:>7.1f}", flush=True)
    if rank == 0:
        drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        print(f"after {args.steps} steps the largest parameter difference from eager is {drift:.2e}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    mp.start_processes(train, args=(args.world_size, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
