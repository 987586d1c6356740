"""Long-prompt inference of ``backend="ulysses"`` against one process, side by side on P CPU (gloo) ranks.

    python examples/inference_benchmark.py                           # prompt 16,384, 64 new tokens, P = 2 and 4
    python examples/inference_benchmark.py --prompt 4096 --new 16 --world-sizes 2

For the transformers Llama of ``benchmark.py`` (hidden 256, 4 layers, 8 heads and 8 key/value heads,
vocab 8192, fp32) and one prompt, a greedy decode as a hand-written loop writes it: the prompt's call
with a KV cache (``use_cache=True``, ``logits_to_keep=1``), then one call per new token over the cache.
Each configuration runs in fresh processes, each with the threads of one of P ranks: one process
(``torch.compile``, Inductor) and P ranks (``torch.compile(model, backend="ulysses")``, every rank passing
the whole prompt). The loop runs twice (the first compiles) and the second is measured: the prompt's
time, the median time per new token, the peak resident memory growth of the prompt's call and of the
decoding loop (the largest rank's), the KV cache each rank holds, and whether the greedy tokens are one
process's. At P = 4 on 2 cores the ranks share the cores (the times measure oversubscription as much as
the program); memory and cache bytes are the figures that carry over.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchmark import build_model, free_port, threads_per_rank, token_ids
from zero_memory import MMAP_THRESHOLD, MMAP_THRESHOLD_ENV, peak_bytes


def greedy(model, ids: torch.Tensor, new: int) -> dict:
    """The prompt's call and ``new - 1`` decoding calls; their times, peak memory growths and tokens."""
    figures, tokens, steps = {}, [], []
    state = {}

    def prompt():
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        state["token"], state["cache"] = out.logits[:, -1:].argmax(-1), out.past_key_values
        tokens.append(int(state["token"]))
        figures["prompt_seconds"] = time.perf_counter() - started

    def decode():
        for _ in range(new - 1):
            started = time.perf_counter()
            out = model(input_ids=state["token"], past_key_values=state["cache"], use_cache=True)
            state["token"], state["cache"] = out.logits[:, -1:].argmax(-1), out.past_key_values
            tokens.append(int(state["token"]))
            steps.append(time.perf_counter() - started)

    with torch.no_grad():
        figures["prompt_peak_bytes"] = peak_bytes(prompt)
        figures["decode_peak_bytes"] = peak_bytes(decode)
    figures["seconds_per_token"] = statistics.median(steps)
    figures["tokens"] = tokens
    figures["cache_bytes"] = _cache_bytes(state["cache"])
    return figures


def _cache_bytes(cache) -> int:
    """The bytes of keys and values this process holds (a rank: its block, never gathered here)."""
    held = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            block = getattr(tensor, "_block", tensor)
            held += block.numel() * block.element_size()
    return held


def _rank(rank: int, world_size: int, port: int, ranks: int, prompt: int, new: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    if ranks > 1:
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        model = build_model(prompt + new)
        compiled = torch.compile(model, backend="ulysses") if ranks > 1 else torch.compile(model)
        ids = token_ids(prompt)
        greedy(compiled, ids, new)  # compiles the prompt's graph and the decoding step's
        results.put((rank, greedy(compiled, ids, new)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def on_ranks(ranks: int, world_size: int, prompt: int, new: int) -> dict:
    """The figures of ``ranks`` fresh processes with the threads of one of ``world_size`` ranks each: the
    slowest rank's times, the largest rank's memory."""
    results = mp.get_context("spawn").SimpleQueue()
    os.environ[MMAP_THRESHOLD_ENV] = MMAP_THRESHOLD  # freed blocks leave at once: the peaks are the step's
    try:
        mp.start_processes(_rank, args=(world_size, free_port(), ranks, prompt, new, results), nprocs=ranks,
                           start_method="spawn")
    finally:
        os.environ.pop(MMAP_THRESHOLD_ENV, None)
    per_rank = [figures for _, figures in sorted(results.get() for _ in range(ranks))]
    assert all(figures["tokens"] == per_rank[0]["tokens"] for figures in per_rank), "ranks chose different tokens"
    worst = dict(per_rank[0])
    for name in ("prompt_seconds", "seconds_per_token", "prompt_peak_bytes", "decode_peak_bytes", "cache_bytes"):
        worst[name] = max(figures[name] for figures in per_rank)
    return worst


def _agreed(tokens: list, reference: list) -> str:
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))
    return f"{same}/{len(reference)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    mib = 2 ** 20
    print(f"prompt {args.prompt:,} tokens, {args.new} new tokens (greedy)\n")
    print(f"{'P':>2} {'run':<9} {'prompt s':>9} {'ms/token':>9} {'prompt peak MiB':>16} {'of one':>7} "
          f"{'decode peak MiB':>16} {'of one':>7} {'KV cache MiB':>13} {'of one':>7} {'tokens':>7}")
    for world_size in args.world_sizes:
        one = on_ranks(1, world_size, args.prompt, args.new)
        ours = on_ranks(world_size, world_size, args.prompt, args.new)
        for label, row in (("one", one), ("ulysses", ours)):
            print(f"{world_size:>2} {label:<9} {row['prompt_seconds']:>9.2f} {row['seconds_per_token'] * 1e3:>9.1f} "
                  f"{row['prompt_peak_bytes'] / mib:>16.1f} {row['prompt_peak_bytes'] / one['prompt_peak_bytes']:>7.2f} "
                  f"{row['decode_peak_bytes'] / mib:>16.1f} {row['decode_peak_bytes'] / max(one['decode_peak_bytes'], 1):>7.2f} "
                  f"{row['cache_bytes'] / mib:>13.1f} {row['cache_bytes'] / one['cache_bytes']:>7.2f} "
                  f"{_agreed(row['tokens'], one['tokens']):>7}", flush=True)


if __name__ == "__main__":
    main()
