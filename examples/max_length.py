"""The longest sequence whose training step fits a per-rank memory cap, for one process, the ulysses
backend, DeepSpeed-Ulysses and ALST, on P CPU (gloo) ranks.

    python examples/max_length.py                                  # P = 2, cap 1 GiB per rank
    python examples/max_length.py --world-sizes 2 4 --cap-mib 768 --granule 128 --out max_length
    python examples/max_length.py --world-sizes 4 --configs ulysses alst --probe 36864 55296   # these S only

The model has real proportions for its size: a transformers Llama with a 32K vocabulary (hidden 256,
4 layers, 8 heads), one sequence, gradient checkpointing on every decoder layer (non-reentrant), a full
training step (forward, backward, AdamW step). Configurations, each in fresh processes:

- one:             one process, ``torch.compile`` (aot_eager, as all compiled rows here, to keep the
                   many compiles of a search short);
- ulysses:         P ranks, ``parallelize(zero_stage=0)`` (``backend="ulysses"`` with the options a
                   README user has: the logits gathered only when read, the loss over them in chunks
                   of rows);
- ulysses_memory:  P ranks, every memory option on: ``parallelize(zero_stage=3)`` (parameters,
                   gradients and AdamW state in 1/P as well);
- deepspeed:       P ranks, DeepSpeed's ``DistributedAttention`` in eager, fed each rank's block, its
                   position ids and pre-shifted labels, a hand-written global loss and one flat gradient
                   all-reduce (examples/benchmark.py's program; needs ``pip install deepspeed``);
- alst:            P ranks, ALST from the installed DeepSpeed with all its hand-added memory pieces
                   (``UlyssesSPAttentionHF``, ``UlyssesSPDataLoaderAdapter``, ``TiledMLP``,
                   ``TiledFusedLogitsLoss``, checkpointing) set up as its tutorial does, but without the
                   DeepSpeed engine, whose gradient averaging is written out (its loss and gradients
                   equal eager's).

Memory is what a rank holds of the model's parameters and AdamW state (counted from the tensors: a
ZeRO shard is its rows) plus the peak resident memory growth of a measured step after a warm-up step
(gradients, activations, transients; ``zero_memory.peak_bytes``, glibc returning every block over
64 KiB at once), the largest rank's. On a CPU nothing fails at a
cap, so the search measures: the peak is close to linear in S once attention is memory-efficient, so two
lengths give a line, its crossing with the cap is measured, and the search steps down by bisection
until a length fits (lengths are multiples of ``--granule`` x P). Printed: the longest length per
configuration and P, with its measured peak, and its ratios to one process's, DeepSpeed's and ALST's; written:
OUT.json and OUT.png (peak memory against S, the cap drawn).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from benchmark import free_port, log, threads_per_rank
from transformers import LlamaConfig, LlamaForCausalLM
from zero_memory import MMAP_THRESHOLD, MMAP_THRESHOLD_ENV, _bytes, peak_bytes

VOCAB = 32768
CONFIGURATIONS = ("one", "ulysses", "ulysses_memory", "deepspeed", "alst")
LOSS_CHUNK_ELEMENTS = 2**22  # logits per chunk of ALST's tiled loss, as the ulysses backend's tiled loss


def build_model(seq_len: int, attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq_len,
                         attn_implementation=attention)
    model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def token_ids(seq_len: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(0))


def compiled_step(model, ids: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()

    return step, model, optimizer


def one_process(seq_len: int, world_size: int, rank: int):
    return compiled_step(torch.compile(build_model(seq_len), backend="aot_eager"), token_ids(seq_len))


def ulysses(seq_len: int, world_size: int, rank: int):
    import ulysses_compile

    model = ulysses_compile.parallelize(build_model(seq_len), zero_stage=0, compiler="aot_eager")
    return compiled_step(model, token_ids(seq_len))


def ulysses_memory(seq_len: int, world_size: int, rank: int):
    import ulysses_compile

    model = ulysses_compile.parallelize(build_model(seq_len), zero_stage=3, compiler="aot_eager")
    return compiled_step(model, token_ids(seq_len))


def deepspeed(seq_len: int, world_size: int, rank: int):
    from benchmark import deepspeed_ulysses_step, register_deepspeed_attention

    register_deepspeed_attention()
    model = build_model(seq_len, attention="deepspeed_ulysses")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return deepspeed_ulysses_step(model, token_ids(seq_len), world_size, rank, optimizer), model, optimizer


def alst(seq_len: int, world_size: int, rank: int):
    """ALST as DeepSpeed's tutorial sets it up, with every memory piece it offers, driven without the
    DeepSpeed engine: ``UlyssesSPAttentionHF`` registered over SDPA, ``UlyssesSPDataLoaderAdapter``
    handing each rank its block with position ids and ``shift_labels``, ``TiledMLP`` patched into every
    MLP, the base model's hidden states fed to ``TiledFusedLogitsLoss`` over the LM head, the global mean
    loss written by hand, and the gradients averaged in one flat buffer (the engine's job)."""
    import math

    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
        TiledMLP,
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from torch.distributed.nn.functional import all_reduce
    from torch.utils.data import DataLoader
    from transformers.models.llama import modeling_llama

    deepspeed.init_distributed(dist_backend="gloo")

    def mlp_forward(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def tiled_mlp_forward(mlp, x):
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        return TiledMLP.apply(mlp_forward, mlp, x, shards, [mlp.down_proj.weight, mlp.gate_proj.weight,
                                                             mlp.up_proj.weight])

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    model = build_model(seq_len)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world_size, micro_batch_size=1,
                                                          seq_length=seq_len, seq_length_is_variable=False)
    group = mpu.get_sequence_parallel_group()
    ids = token_ids(seq_len)
    sample = {"input_ids": ids[0], "position_ids": torch.arange(seq_len), "labels": ids[0]}
    batch = next(iter(UlyssesSPDataLoaderAdapter(DataLoader([sample], batch_size=1), sp_rank=rank, sp_group=group,
                                                 sp_world_size=world_size, device="cpu")))
    shift_labels = batch["shift_labels"]
    total_tokens = (shift_labels != -100).sum()
    dist.all_reduce(total_tokens, group=group)
    shards = max(1, math.ceil(shift_labels.numel() * VOCAB / LOSS_CHUNK_ELEMENTS))

    def loss_sum(lm_head, hidden, labels):
        # TiledFusedLogitsLoss differentiates its chunks inside its forward, with a gradient of 1: its
        # backward scales only the hidden states' gradient, so the weight's scale goes in here (P / T)
        summed = F.cross_entropy(lm_head(hidden).float().flatten(0, -2), labels.flatten(), ignore_index=-100,
                                 reduction="sum")
        return summed * world_size / total_tokens

    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             use_cache=False).last_hidden_state
        local = TiledFusedLogitsLoss.apply(loss_sum, model.lm_head, hidden, shift_labels, None, shards,
                                           [model.lm_head.weight], "sum")
        loss = all_reduce(local, group=group) / world_size
        loss.backward()
        grads = torch._utils._flatten_dense_tensors([p.grad for p in parameters])
        dist.all_reduce(grads, group=group)
        grads /= world_size  # the engine averages over its sequence-data-parallel group
        for p, synced in zip(parameters, torch._utils._unflatten_dense_tensors(grads, [p.grad for p in parameters])):
            p.grad.copy_(synced)
        del grads, synced  # the engine's buckets are free by the optimizer step
        optimizer.step()
        return loss.detach()

    return step, model, optimizer


PROGRAMS = {"one": one_process, "ulysses": ulysses, "ulysses_memory": ulysses_memory, "deepspeed": deepspeed,
            "alst": alst}


def _rank(rank: int, world_size: int, port: int, config: str, seq_len: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    if config != "one":
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        step, model, optimizer = PROGRAMS[config](seq_len, world_size, rank)
        step()  # compiles; creates the gradients and the optimizer state
        held = _bytes(model.parameters()) + _bytes(value for state in optimizer.state.values()
                                                   for value in state.values())
        results.put(held + peak_bytes(step))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measured_peak(config: str, world_size: int, seq_len: int) -> int:
    """The largest rank's peak memory growth of one step of ``config`` at ``seq_len``, in fresh processes."""
    results = mp.get_context("spawn").SimpleQueue()
    ranks = 1 if config == "one" else world_size
    os.environ[MMAP_THRESHOLD_ENV] = MMAP_THRESHOLD
    try:
        mp.start_processes(_rank, args=(world_size, free_port(), config, seq_len, results), nprocs=ranks,
                           start_method="spawn")
    finally:
        os.environ.pop(MMAP_THRESHOLD_ENV, None)
    return max(results.get() for _ in range(ranks))


def longest(config: str, world_size: int, cap: int, granule: int, probes: dict) -> int:
    """The longest multiple of ``granule`` whose step peaks within ``cap``; ``probes`` collects every
    measurement (length -> bytes)."""

    def fits(length: int) -> bool:
        if length not in probes:
            started = time.perf_counter()
            probes[length] = measured_peak(config, world_size, length)
            log(f"{config} P={world_size} S={length}: {probes[length] / 2**20:.0f} MiB "
                f"({time.perf_counter() - started:.0f} s)")
        return probes[length] <= cap

    first, second = 2 * granule, 4 * granule
    if not fits(first):
        return 0
    fits(second)
    slope = max((probes[second] - probes[first]) / (second - first), 1.0)
    guess = max(second, int(first + (cap - probes[first]) / slope) // granule * granule)
    low, high = first, None  # low fits; high, once found, does not
    for candidate in [second, guess, *(guess + guess * step // 4 for step in range(1, 8))]:
        candidate = candidate // granule * granule
        if candidate <= low:
            continue
        if not fits(candidate):
            high = candidate
            break
        low = candidate
    if high is None:
        return low
    while high - low > granule:
        middle = (low + high) // 2 // granule * granule
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--cap-mib", type=int, default=1024, help="memory cap per rank (peak growth of a step)")
    parser.add_argument("--granule", type=int, default=256, help="lengths searched are multiples of this x P")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGURATIONS), choices=CONFIGURATIONS)
    parser.add_argument("--out", default="max_length", help="writes OUT.json and OUT.png")
    parser.add_argument("--probe", type=int, nargs="+",
                        help="measure the peak at these lengths only (no search); the longest within the cap")
    args = parser.parse_args()
    cap = args.cap_mib * 2**20
    rows = []

    def row(config: str, world_size: int, length: int, probes: dict) -> dict:
        return {"config": config, "P": world_size, "longest": length, "peak_bytes": probes.get(length, 0),
                "probes": dict(sorted(probes.items()))}

    def probe(config: str, world_size: int) -> dict:
        probes = {}
        for length in args.probe:
            probes[length] = measured_peak(config, world_size, length)
            print(f"{config} P={world_size} S={length}: {probes[length] / 2**20:.0f} MiB "
                  f"({'within' if probes[length] <= cap else 'over'} {args.cap_mib} MiB)", flush=True)
        return row(config, world_size, max((n for n, peak in probes.items() if peak <= cap), default=0), probes)

    def search(config: str, world_size: int) -> dict:
        probes: dict[int, int] = {}
        granule = args.granule * (1 if config == "one" else world_size)
        return row(config, world_size, longest(config, world_size, cap, granule, probes), probes)

    measure = probe if args.probe else search
    one = measure("one", 1) if "one" in args.configs else None  # one process does not depend on P
    for world_size in args.world_sizes:
        rows += [{**one, "P": world_size}] if one else []
        rows += [measure(config, world_size) for config in args.configs if config != "one"]
    report(rows, args.cap_mib, "the longest length probed" if args.probe else "the longest sequence")
    with open(f"{args.out}.json", "w") as out:
        json.dump({"cap_mib": args.cap_mib, "vocab": VOCAB, "rows": rows}, out, indent=1)
    plot(rows, args.cap_mib, f"{args.out}.png")


def report(rows: list[dict], cap_mib: int, what: str) -> None:
    print(f"{what} whose training step fits {cap_mib} MiB per rank (Llama, vocab {VOCAB}, "
          f"hidden 256, 4 layers, checkpointing, AdamW):")
    by = {(row["config"], row["P"]): row for row in rows}
    for (config, world_size), row in by.items():
        bases = {name: by.get((name, world_size), {}).get("longest") or 0 for name in ("one", "deepspeed", "alst")}
        ratios = "".join(f"  {row['longest'] / base:.2f}x {name}" for name, base in bases.items()
                         if base and config != "one" and name != config)
        print(f"  P={world_size} {config:<15} S = {row['longest']:>6}  peak {row['peak_bytes'] / 2**20:7.0f} MiB{ratios}")


def plot(rows: list[dict], cap_mib: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if row["config"] == "one" and row is not rows[0]:
            continue
        lengths = sorted(int(length) for length in row["probes"])
        label = row["config"] if row["config"] == "one" else f"{row['config']} P={row['P']}"
        axis.plot(lengths, [row["probes"][length] / 2**20 for length in lengths], marker="o", label=label)
    axis.axhline(cap_mib, color="grey", linestyle="--", label="cap")
    axis.set_xlabel("sequence length S")
    axis.set_ylabel("parameters + AdamW state + step peak, per rank (MiB)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    main()
