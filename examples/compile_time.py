"""Compile time of a deep model on P CPU (gloo) ranks with Inductor: the whole model compiled at once
against regional compilation (each decoder layer compiled on its own, the one compiled code reused by
every layer, as torchtitan and accelerate do), and how many compiles a sweep of lengths costs.

    python examples/compile_time.py                          # P = 2, 32 layers
    python examples/compile_time.py --layers 8 --lengths 256 258 260 264 272

The model is a transformers Llama with 32 layers and a small width (hidden 64, 4 heads, vocab 1024),
so compilation, not compute, dominates. For each mode, in fresh processes: the first training step's
time less a later step's (the compile), the seconds spent in our passes (each graph's
``report.pass_seconds``), the graphs compiled over the sweep of lengths (Dynamo's ``unique_graphs``;
the first length compiles for that length, the next for any length), and the all-gathers a step calls
on the process group, counted by torch's profiler as they run (with regional compilation a layer's
sequence-sharded output reaches the next layer's graph, which takes its block as it is; a gather there
would be inside the compiled code, which the passes' reports do not show). The losses of the two modes
are printed: they must agree.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from benchmark import free_port, log, threads_per_rank
from transformers import LlamaConfig, LlamaForCausalLM
from zero_memory import collectives_by_kind

VOCAB = 1024
MODES = ("whole", "regional")


def build_model(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _rank(rank: int, world_size: int, port: int, mode: str, layers: int, lengths: list[int], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from ulysses_compile import ulysses
    from ulysses_compile.core.compat import dynamo_counters

    reports = []

    def backend(gm, example_inputs):
        compiled = ulysses(gm, example_inputs)
        reports.append(gm.meta.get("ulysses_report"))
        return compiled

    try:
        model = build_model(layers)
        if mode == "whole":
            model = torch.compile(model, backend=backend)
        else:
            for layer in model.model.layers:
                layer.compile(backend=backend)

        def step(length: int) -> float:
            ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss.item()

        started = time.perf_counter()
        losses = [step(lengths[0])]
        first = time.perf_counter() - started
        started = time.perf_counter()
        losses.append(step(lengths[0]))
        again = time.perf_counter() - started
        called = collectives_by_kind(lambda: losses.append(step(lengths[0])))
        gathers = sum(count for kind, count in called.items() if "allgather" in kind)
        for length in lengths[1:]:
            losses.append(step(length))
        results.put((rank, {
            "compile_seconds": first - again, "step_seconds": again,
            "pass_seconds": sum(sum(report.pass_seconds.values()) for report in reports if report),
            "graphs": dynamo_counters["stats"]["unique_graphs"], "gathers_per_step": gathers,
            "losses": losses,
        }))
    finally:
        dist.destroy_process_group()


def measured(mode: str, world_size: int, layers: int, lengths: list[int]) -> dict:
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(world_size, free_port(), mode, layers, lengths, results), nprocs=world_size,
                       start_method="spawn")
    per_rank = [figures for _, figures in sorted(results.get() for _ in range(world_size))]
    return {**per_rank[0], "compile_seconds": max(figures["compile_seconds"] for figures in per_rank)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 258, 260, 264, 272],
                        help="the sweep: the first is compiled and timed, the rest count recompiles")
    args = parser.parse_args()
    rows = {}
    for mode in MODES:
        log(f"{mode}: {args.layers} layers at P = {args.world_size} ...")
        rows[mode] = measured(mode, args.world_size, args.layers, args.lengths)
    for mode, row in rows.items():
        print(f"{mode:<8} compile {row['compile_seconds']:6.1f} s (our passes {row['pass_seconds']:5.1f} s, "
              f"{row['pass_seconds'] / row['compile_seconds']:.0%}), step {row['step_seconds']:.2f} s, "
              f"{row['graphs']} graphs over lengths {args.lengths}, all-gathers a step {row['gathers_per_step']}")
    whole, regional = rows["whole"], rows["regional"]
    print(f"regional / whole compile time: {regional['compile_seconds'] / whole['compile_seconds']:.2f}; "
          f"losses whole {[f'{loss:.6f}' for loss in whole['losses']]}, regional "
          f"{[f'{loss:.6f}' for loss in regional['losses']]}")


if __name__ == "__main__":
    main()
