"""What the collectives of one training step of the benchmark's Llama cost on their own, on P gloo ranks:
the most that overlapping them with compute, or fusing them, can win.

    python examples/collective_cost.py                       # P = 2, S = 4096
    python examples/collective_cost.py --world-size 4 --seq-len 8192

Each figure is the median over ``--repeats`` calls after an untimed one, the ranks aligned by a barrier
before each call, so no rank waits for a slower one; the slowest rank's median is printed:

- one all-to-all of a [S/P, H, D] fp32 activation (the attention output), as the compiled program
  issues it (functional collective, then ``wait_tensor``);
- q, k and v as three all-to-alls against one all-to-all of the three stacked, as the compiled program
  sends them: what fusing them saves; a step has one of each per layer and direction;
- one all-reduce of every parameter's gradient in one bucket, as the backend's bucketing leaves it, and
  one reduce-scatter of it (ZeRO's gradient collective): what each micro-step of gradient accumulation
  pays, since the gradients are reduced inside every backward;
- their sum over a step: the time communication takes when it runs alone. The benchmark's
  "communication costs" (a step's time less its compute-only time) above this sum is time the ranks
  spend waiting for each other and competing for the cores, which no reordering of collectives hides.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
import torch.multiprocessing as mp
from benchmark import build_model, free_port, threads_per_rank


def _median_ms(call, repeats: int) -> float:
    call()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return 1000 * statistics.median(seconds)


def _all_to_all(x: torch.Tensor) -> torch.Tensor:
    return functional.wait_tensor(functional.all_to_all_single(x, None, None, dist.group.WORLD))


def _rank(rank: int, world_size: int, port: int, seq_len: int, repeats: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = build_model(seq_len)
        config = model.config
        activation = torch.randn(seq_len // world_size * config.num_attention_heads * config.head_dim)
        stacked = torch.cat([activation] * 3)
        parameters = sum(p.numel() for p in model.parameters())
        gradients = torch.randn(parameters + (-parameters) % world_size)
        shard = gradients.new_empty(gradients.numel() // world_size)
        results.put((rank, {
            "all_to_all_ms": _median_ms(lambda: _all_to_all(activation), repeats),
            "q_k_v_apart_ms": _median_ms(lambda: [_all_to_all(activation) for _ in range(3)], repeats),
            "q_k_v_fused_ms": _median_ms(lambda: _all_to_all(stacked), repeats),
            "gradient_all_reduce_ms": _median_ms(lambda: dist.all_reduce(gradients), repeats),
            "gradient_reduce_scatter_ms": _median_ms(lambda: dist.reduce_scatter_single(shard, gradients), repeats),
            "layers": config.num_hidden_layers,
            "gradient_bytes": gradients.numel() * gradients.element_size(),
            "activation_bytes": activation.numel() * activation.element_size(),
        }))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(args.world_size, port, args.seq_len, args.repeats, results),
                       nprocs=args.world_size, start_method="spawn")
    per_rank = [figures for _, figures in sorted(results.get() for _ in range(args.world_size))]
    worst = {name: max(figures[name] for figures in per_rank) for name in per_rank[0]}
    # per layer and direction: q, k and v in one all-to-all, the output in another
    per_step = 2 * worst["layers"] * (worst["q_k_v_fused_ms"] + worst["all_to_all_ms"]) + worst["gradient_all_reduce_ms"]
    fusing_saves = 2 * worst["layers"] * (worst["q_k_v_apart_ms"] - worst["q_k_v_fused_ms"])
    print(f"P={args.world_size} S={args.seq_len}: all-to-all of {worst['activation_bytes'] / 2**20:.1f} MiB "
          f"{worst['all_to_all_ms']:.2f} ms; q, k, v apart {worst['q_k_v_apart_ms']:.2f} ms, fused "
          f"{worst['q_k_v_fused_ms']:.2f} ms (fused, as the backend sends them: {fusing_saves:.0f} ms a step saved); "
          f"gradient all-reduce of "
          f"{worst['gradient_bytes'] / 2**20:.1f} MiB {worst['gradient_all_reduce_ms']:.1f} ms, reduce-scatter "
          f"{worst['gradient_reduce_scatter_ms']:.1f} ms; a step's "
          f"{4 * worst['layers']} all-to-alls and the all-reduce alone: {per_step:.0f} ms")


if __name__ == "__main__":
    main()
