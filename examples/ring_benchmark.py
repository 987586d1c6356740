"""Ulysses alone, Ulysses x ring and the ring alone on the same P gloo ranks, side by side in one run.

    python examples/ring_benchmark.py                          # P = 4, S = 4096
    python examples/ring_benchmark.py --seq-len 8192 --steps 3

The benchmark's Llama (4 layers, hidden 256, 8 heads, vocab 8192, one sequence, fp32) is trained for a
step (forward and backward, no optimizer) under each plan the option ``ring`` sets: 1 (Ulysses over
every rank), 2 (Ulysses over P / 2 ranks, a ring of 2), P (a ring alone). For each: the loss (equal across plans, and to one process's), the
largest rank's peak memory growth over a step against one process's, the bytes each rank sends by
all-to-all and round the ring against their minimum (``explain``'s accounting, asserted equal), and the
slowest rank's step time. At P = 4 on 2 cores the ranks share the cores, so the time measures
oversubscription as much as the plan; memory and bytes are the figures that carry over.

USP (``yunchang`` 0.6.4) is not in the table: it does not train on a CPU. Its ring over torch's
attention ("basic" with ``AttnType.TORCH_MATH``) has no backward ("Not implemented backward for PyTorch
attention types"), and its torch ring ("basic_pytorch") calls ``aten._scaled_dot_product_flash_attention``,
which has no CPU kernel; its other kernels are flash-attn's, FlashInfer's or NPU's.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchmark import build_model, free_port, measured, threads_per_rank, token_ids, training_step, worst_rank
from zero_memory import MMAP_THRESHOLD, MMAP_THRESHOLD_ENV


def _rank(rank, world_size, port, ring, seq_len, steps, measure, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    if ring is not None:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        losses = []
        model = build_model(seq_len)
        compiled = torch.compile(model, backend="ulysses", options={"ring": ring}) if ring is not None else \
            torch.compile(model)
        figures = measured(training_step(compiled, token_ids(seq_len), losses), measure, steps)
        results.put((rank, {**figures, "loss": losses[0]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def on_ranks(ring, world_size: int, seq_len: int, steps: int, measure: str) -> dict:
    """The largest rank's figures for ``ring`` (None: one process with one rank's threads)."""
    ranks = 1 if ring is None else world_size
    results = mp.get_context("spawn").SimpleQueue()
    if measure == "memory":
        os.environ[MMAP_THRESHOLD_ENV] = MMAP_THRESHOLD
    try:
        mp.start_processes(_rank, args=(world_size, free_port(), ring, seq_len, steps, measure, results),
                           nprocs=ranks, start_method="spawn")
    finally:
        os.environ.pop(MMAP_THRESHOLD_ENV, None)
    return worst_rank(results, ranks)


def communication(ring: int, world_size: int, seq_len: int) -> dict:
    from ulysses_compile import explain

    ids = token_ids(seq_len)
    report = explain(build_model(seq_len), input_ids=ids, labels=ids, use_cache=False, world_size=world_size,
                     options={"ring": ring})
    ring_bytes = sum(call.bytes for call in report.collectives if call.kind == "ring")
    plans = {f"Ulysses {site.ulysses} x ring {site.ring}" for graph in report.graphs for site in graph.attention_sites}
    return {"plan": "; ".join(sorted(plans)), "all_to_all": report.all_to_all_bytes(),
            "all_to_all_minimum": report.ulysses_minimum_bytes, "ring": ring_bytes,
            "ring_minimum": report.ring_minimum_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    world_size = args.world_size
    rings = [ring for ring in (1, 2, world_size) if world_size % ring == 0 and ring <= world_size]
    one = on_ranks(None, world_size, args.seq_len, args.steps, "memory")
    print(f"P = {world_size}, S = {args.seq_len}: one process peaks {one['peak_bytes'] / 2**20:.1f} MiB a step, "
          f"loss {one['loss']:.6f}\n")
    print(f"{'ring':>4}  {'plan':<22} {'loss':>10} {'peak MiB':>9} {'of one':>7} {'all-to-all B':>13} "
          f"{'min':>13} {'ring B':>12} {'min':>12} {'step s':>7}")
    for ring in dict.fromkeys(rings):
        sent = communication(ring, world_size, args.seq_len)
        assert sent["all_to_all"] == sent["all_to_all_minimum"] and sent["ring"] == sent["ring_minimum"], sent
        memory = on_ranks(ring, world_size, args.seq_len, args.steps, "memory")
        timed = on_ranks(ring, world_size, args.seq_len, args.steps, "time")
        print(f"{ring:>4}  {sent['plan']:<22} {memory['loss']:>10.6f} {memory['peak_bytes'] / 2**20:>9.1f} "
              f"{memory['peak_bytes'] / one['peak_bytes']:>7.2f} {sent['all_to_all']:>13,} "
              f"{sent['all_to_all_minimum']:>13,} {sent['ring']:>12,} {sent['ring_minimum']:>12,} "
              f"{timed['seconds']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
