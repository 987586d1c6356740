"""Ulysses alone, Ulysses x ring and the ring alone on the same P gloo ranks, side by side in one run.

    python examples/ring_benchmark.py                          # P = 4, S = 4096
    python examples/ring_benchmark.py --seq-len 8192 --steps 3

The benchmark's Llama (4 layers, hidden 256, 8 heads, vocab 8192, one sequence, fp32) is trained for a
step (forward and backward, no optimizer) under each plan the option ``ring`` sets: 1 (Ulysses over
every rank), 2 (Ulysses over P / 2 ranks, a ring of 2), P (a ring alone), and P again with the option
``layout="contiguous"`` (the ring's blocks in contiguous order rather than head-tail). For each: the loss
(equal across plans, and to one process's), the largest rank's peak memory growth over a step against
one process's, the bytes each rank sends by all-to-all and round the ring against their minimum
(``explain``'s accounting, asserted equal), the slowest rank's step time, and the CPU seconds each rank
spends in the ring's attention blocks a step, slowest / fastest rank (the causal work's balance). At
P = 4 on 2 cores the ranks share the cores, so the step time measures oversubscription as much as the
plan; memory, bytes and the CPU seconds per rank are the figures that carry over.

USP (``yunchang`` 0.6.4) is not in the table: it does not train on a CPU. Its ring over torch's
attention ("basic" with ``AttnType.TORCH_MATH``) has no backward ("Not implemented backward for PyTorch
attention types"), and its torch ring ("basic_pytorch") calls ``aten._scaled_dot_product_flash_attention``,
which has no CPU kernel; its other kernels are flash-attn's, FlashInfer's or NPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchmark import build_model, free_port, measured, threads_per_rank, token_ids, training_step, worst_rank
from zero_memory import MMAP_THRESHOLD, MMAP_THRESHOLD_ENV


def _rank(rank, world_size, port, options, seq_len, steps, measure, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    if options is not None:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        losses = []
        model = build_model(seq_len)
        compiled = torch.compile(model, backend="ulysses", options=options) if options is not None else \
            torch.compile(model)
        with _attention_cpu_seconds() as spent:
            figures = measured(training_step(compiled, token_ids(seq_len), losses), measure, steps)
        results.put((rank, {**figures, "loss": losses[0], "attention_seconds": spent[0] / (steps + 1)}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _attention_cpu_seconds():
    """The CPU seconds of the calling thread (one per rank here: the kernels' own, not gloo's sends)
    the ring's attention blocks take, forward and backward, summed into ``[seconds]`` (the blocks are
    module functions the ring's ops look up at each call)."""
    from ulysses_compile.core import ring_attention

    spent = [0.0]
    originals = ring_attention._block_forward, ring_attention._block_backward

    def timed(block):
        def run(*args):
            started = time.thread_time()
            result = block(*args)
            spent[0] += time.thread_time() - started
            return result

        return run

    ring_attention._block_forward, ring_attention._block_backward = (timed(block) for block in originals)
    try:
        yield spent
    finally:
        ring_attention._block_forward, ring_attention._block_backward = originals


def on_ranks(options, world_size: int, seq_len: int, steps: int, measure: str) -> dict:
    """The largest rank's figures for ``options`` (None: one process with one rank's threads)."""
    ranks = 1 if options is None else world_size
    results = mp.get_context("spawn").SimpleQueue()
    if measure == "memory":
        os.environ[MMAP_THRESHOLD_ENV] = MMAP_THRESHOLD
    try:
        mp.start_processes(_rank, args=(world_size, free_port(), options, seq_len, steps, measure, results),
                           nprocs=ranks, start_method="spawn")
    finally:
        os.environ.pop(MMAP_THRESHOLD_ENV, None)
    return worst_rank(results, ranks, spread=("attention_seconds",))


def communication(options: dict, world_size: int, seq_len: int) -> dict:
    from ulysses_compile import explain

    ids = token_ids(seq_len)
    report = explain(build_model(seq_len), input_ids=ids, labels=ids, use_cache=False, world_size=world_size,
                     options=options)
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
    plans = {f"{ring}": {"ring": ring} for ring in (1, 2, world_size) if world_size % ring == 0}
    plans[f"{world_size} contiguous"] = {"ring": world_size, "layout": "contiguous"}
    one = on_ranks(None, world_size, args.seq_len, args.steps, "memory")
    print(f"P = {world_size}, S = {args.seq_len}: one process peaks {one['peak_bytes'] / 2**20:.1f} MiB a step, "
          f"loss {one['loss']:.6f}\n")
    print(f"{'ring':>12}  {'plan':<22} {'loss':>10} {'peak MiB':>9} {'of one':>7} {'all-to-all B':>13} "
          f"{'min':>13} {'ring B':>12} {'min':>12} {'step s':>7} {'attention CPU s':>18}")
    for label, options in plans.items():
        sent = communication(options, world_size, args.seq_len)
        assert sent["all_to_all"] == sent["all_to_all_minimum"] and sent["ring"] == sent["ring_minimum"], sent
        memory = on_ranks(options, world_size, args.seq_len, args.steps, "memory")
        timed = on_ranks(options, world_size, args.seq_len, args.steps, "time")
        fastest, slowest = timed["attention_seconds"]
        attention = f"{slowest:.2f}/{fastest:.2f}={slowest / fastest:.2f}" if fastest else "-"
        print(f"{label:>12}  {sent['plan']:<22} {memory['loss']:>10.6f} {memory['peak_bytes'] / 2**20:>9.1f} "
              f"{memory['peak_bytes'] / one['peak_bytes']:>7.2f} {sent['all_to_all']:>13,} "
              f"{sent['all_to_all_minimum']:>13,} {sent['ring']:>12,} {sent['ring_minimum']:>12,} "
              f"{timed['seconds']:>7.2f} {attention:>18}", flush=True)


if __name__ == "__main__":
    main()
