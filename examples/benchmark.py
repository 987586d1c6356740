"""Step time, memory and communication of ``backend="ulysses"`` against hand-written DeepSpeed-Ulysses and
one process, side by side on P CPU (gloo) ranks.

    python examples/benchmark.py                                   # P = 2, S = 4096
    python examples/benchmark.py --world-sizes 2 4 --seq-lens 2048 4096 8192 --out bench

For a transformers Llama (hidden 256, 4 layers, 8 heads, vocab 8192) and one sequence of S tokens, a
training step (forward, backward) is timed: the median of ``--steps`` after a warm-up step that compiles.
Every configuration runs in fresh processes, each with the threads of one of P ranks:

- one:        one process, unsharded, ``torch.compile`` (Inductor), attention by SDPA's causal kernel (an
              HF attention function that ignores the mask HF builds);
- ulysses:    P ranks, ``torch.compile(model, backend="ulysses", options={"outputs": OUTPUTS})``, every
              rank passing the global batch. ``--outputs lazy`` (the backend's default, and here)
              computes the logits only when read (never, here: the step reads the loss, which the
              graph computes from the LM head's input in chunks of rows); ``--outputs local`` also
              returns the rank's logits, so the backward multiplies the zero gradient autograd gives
              an output nobody read (AOTAutograd materializes it); ``--outputs gather`` also
              all-gathers the [S, vocab] logits on every rank;
- deepspeed:  P ranks, the same model in eager with its attention wrapped by DeepSpeed's
              ``DistributedAttention`` (an HF attention function), fed what it needs: each rank's
              sequence block, its position ids and pre-shifted labels, a hand-written global loss and
              one flat all-reduce of the gradients;
- ulysses_compute_only, deepspeed_compute_only: the two programs on P ranks whose process group is
              torch's fake one: collectives move nothing, so this is each rank's share of the work with
              every rank computing at once (on a shared machine, its contention included): the step
              time if communication were free. Its difference to the real run is what a program pays
              for communicating, and the ulysses one bounds what any communication lever can win.

``--repeats R`` times the five (three at P = 1) in turn R times and keeps each one's median run, so a
slow minute of a shared machine does not land on one configuration only. Memory is measured in separate runs (see
``on_ranks``): the peak resident memory growth of a step, the largest rank's.

Printed per (P, S): the medians, ulysses / deepspeed, the parallel efficiency t_one / P / t_ulysses (at
most cores / P where the ranks outnumber the cores), what each program's communication costs (its time
less its compute-only time), the peak memories against one process, the all-to-all calls and bytes of
the compiled program against the Ulysses minimum and every collective of a step, forward and
backward (each one a meeting of the ranks; ``explain``), the compile time with the share of
our passes, and what the per-call check that ranks pass the same inputs costs. A JSON file and a PNG plot are written next to ``--out``. The three losses are printed too:
they must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from zero_memory import MMAP_THRESHOLD, MMAP_THRESHOLD_ENV, peak_bytes

VOCAB = 8192


def causal_attention(module, query, key, value, attention_mask, **kwargs):
    """HF attention with SDPA's causal kernel, ignoring the mask transformers builds: the fastest
    single-process attention, so "one" is not slowed by the masked kernel."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
    return out.transpose(1, 2), None


AttentionInterface.register("causal_sdpa", causal_attention)


def build_model(seq_len: int, attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq_len,
                         attn_implementation=attention)
    return LlamaForCausalLM(config)


def token_ids(seq_len: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(0))


def measured(step, measure: str, steps: int) -> dict:
    """Run ``step`` once (it compiles), then ``steps`` more: their median seconds (``measure="time"``) or
    their largest peak memory growth (``measure="memory"``)."""
    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    if measure == "memory":
        return {"peak_bytes": max(peak_bytes(step) for _ in range(steps))}
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"seconds": median, "compile_seconds": first - median}


def training_step(model, ids: torch.Tensor, losses: list):
    """Forward and backward of the model on the global batch, its loss appended to ``losses``."""

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())

    return step


def one_process(rank: int, world_size: int, seq_len: int, outputs: str, losses: list):
    model = torch.compile(build_model(seq_len, attention="causal_sdpa"))
    return training_step(model, token_ids(seq_len), losses), {}


def ulysses_rank(rank: int, world_size: int, seq_len: int, outputs: str, losses: list):
    from ulysses_compile import ulysses

    pass_seconds = []

    def backend(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, {"outputs": outputs})
        if "ulysses_report" in gm.meta:  # not at P = 1, where nothing is rewritten
            pass_seconds.append(sum(gm.meta["ulysses_report"].pass_seconds.values()))
        return compiled

    model = torch.compile(build_model(seq_len), backend=backend)
    ids = token_ids(seq_len)
    return training_step(model, ids, losses), {"pass_seconds": pass_seconds,
                                               "input_check_seconds": [input_check_seconds(ids)]}


def input_check_seconds(ids: torch.Tensor, calls: int = 20) -> float:
    """What the check that every rank passes the same inputs adds to each call: the median of ``calls``
    runs of it alone on the step's inputs (ids and labels), each settling the previous one's all-gather."""
    from ulysses_compile.agreement import InputCheck

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    check = InputCheck(["input_ids", "labels"], [0, 1], dist.group.WORLD, dist.get_rank(), "benchmark",
                       {"graph": "benchmark", "inputs": {}})
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        check([ids, ids])
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def deepspeed_rank(rank: int, world_size: int, seq_len: int, outputs: str, losses: list):
    register_deepspeed_attention()
    model = build_model(seq_len, attention="deepspeed_ulysses")
    return deepspeed_ulysses_step(model, token_ids(seq_len), world_size, rank, on_loss=losses.append), {}


def register_deepspeed_attention() -> None:
    """HF attention ``"deepspeed_ulysses"``: SDPA's causal kernel wrapped by DeepSpeed's
    ``DistributedAttention`` over the default group."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")

    def local_attention(query, key, value, *args, **kwargs):  # [B, S, H/P, D] on every rank
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             is_causal=True)
        return out.transpose(1, 2)

    distributed = DistributedAttention(local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=1)

    def attention(module, query, key, value, attention_mask, **kwargs):  # HF: [B, H, S/P, D]
        out = distributed(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0)
        return out, None  # [B, S/P, H, D], as HF's attention functions return

    AttentionInterface.register("deepspeed_ulysses", attention)


def deepspeed_ulysses_step(model, ids: torch.Tensor, world_size: int, rank: int, optimizer=None, on_loss=None):
    """A DeepSpeed-Ulysses training step as its users write it: the model (with the
    ``"deepspeed_ulysses"`` attention) fed this rank's block of ``ids``, its position ids and pre-shifted
    labels, a hand-written global loss, one flat all-reduce of the gradients, then ``optimizer.step()``."""
    from torch.distributed.nn.functional import all_reduce

    seq_len = ids.shape[1]
    block = seq_len // world_size
    first_token = rank * block
    local_ids = ids[:, first_token:first_token + block]
    positions = torch.arange(first_token, first_token + block).unsqueeze(0)
    shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)[:, first_token:first_token + block]
    total_tokens = (shifted != -100).sum()
    dist.all_reduce(total_tokens)
    parameters = [p for p in model.parameters() if p.requires_grad]

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=local_ids, position_ids=positions, use_cache=False).logits
        local = F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=-100, reduction="sum")
        loss = all_reduce(local) / total_tokens
        loss.backward()
        grads = torch._utils._flatten_dense_tensors([p.grad for p in parameters])
        dist.all_reduce(grads)
        for p, synced in zip(parameters, torch._utils._unflatten_dense_tensors(grads, [p.grad for p in parameters])):
            p.grad.copy_(synced)
        if optimizer is not None:
            optimizer.step()
        if on_loss is not None:
            on_loss(loss.item())

    return step


CONFIGURATIONS = {"one": one_process, "ulysses": ulysses_rank, "ulysses_compute_only": ulysses_rank,
                  "deepspeed": deepspeed_rank, "deepspeed_compute_only": deepspeed_rank}
COMPUTE_ONLY = ("ulysses_compute_only", "deepspeed_compute_only")  # on torch's fake process group


def _rank(rank: int, world_size: int, port: int, config: str, measure: str, seq_len: int, steps: int,
          outputs: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads_per_rank(world_size))
    if config in COMPUTE_ONLY:
        from ulysses_compile.core.compat import register_fake_backend

        register_fake_backend()
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    elif config != "one":
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        losses = []
        step, extras = CONFIGURATIONS[config](rank, world_size, seq_len, outputs, losses)
        figures = measured(step, measure, steps)
        results.put((rank, {**figures, **{name: sum(values) for name, values in extras.items()},
                            "loss": losses[0]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_ranks(config: str, measure: str, world_size: int, seq_len: int, steps: int, outputs: str) -> dict:
    """``config`` measured on fresh processes (one for "one", else ``world_size``), each with the threads
    of one of ``world_size`` ranks: the slowest rank's time or the largest rank's memory (every rank waits for the slowest).
    glibc's allocator returns every block over 64 KiB at once in memory runs only, so freed tensors
    do not linger into the measured peak; it costs time (page faults), so time runs keep its default."""
    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    ranks = 1 if config == "one" else world_size
    previous = os.environ.pop(MMAP_THRESHOLD_ENV, None)
    if measure == "memory":
        os.environ[MMAP_THRESHOLD_ENV] = MMAP_THRESHOLD  # read by each spawned rank's allocator
    try:
        mp.start_processes(_rank, args=(world_size, port, config, measure, seq_len, steps, outputs, results),
                           nprocs=ranks, start_method="spawn")
    finally:
        os.environ.pop(MMAP_THRESHOLD_ENV, None)
        if previous is not None:
            os.environ[MMAP_THRESHOLD_ENV] = previous
    return worst_rank(results, ranks)


def worst_rank(results, ranks: int, spread: tuple[str, ...] = ()) -> dict:
    """The figures ``ranks`` ranks put in ``results`` as rank 0's, with the slowest time and the largest
    memory of any rank, and for each figure named in ``spread`` its (smallest, largest) over the ranks."""
    per_rank = [figures for _, figures in sorted(results.get() for _ in range(ranks))]
    worst = dict(per_rank[0])
    for name in ("seconds", "peak_bytes"):
        if name in worst:
            worst[name] = max(figures[name] for figures in per_rank)
    for name in spread:
        values = [figures[name] for figures in per_rank]
        worst[name] = (min(values), max(values))
    return worst


def communication(world_size: int, seq_len: int) -> dict:
    from ulysses_compile import explain

    if world_size == 1:
        return {"all_to_all_calls": 0, "all_to_all_bytes": 0, "ulysses_minimum_bytes": 0, "formula_calls": 0,
                "meetings": {"forward": 0, "backward": 0}, "all_to_all_by_phase": {"forward": 0, "backward": 0}}
    ids = token_ids(seq_len)
    model = build_model(seq_len)
    report = explain(model, input_ids=ids, labels=ids, use_cache=False, world_size=world_size)
    calls = {phase: [call for call in report.collectives if call.phase == phase] for phase in ("forward", "backward")}
    return {"all_to_all_calls": sum(1 for call in report.collectives if call.kind == "all_to_all"),
            "all_to_all_bytes": report.all_to_all_bytes(), "ulysses_minimum_bytes": report.ulysses_minimum_bytes,
            # q, k, v in one all-to-all and the output in another, each way, per layer
            "formula_calls": 4 * model.config.num_hidden_layers,
            "meetings": {phase: len(found) for phase, found in calls.items()},
            "all_to_all_by_phase": {phase: sum(1 for call in found if call.kind == "all_to_all")
                                    for phase, found in calls.items()}}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1,
                        help="time every configuration this many times, in turn, and keep each one's median")
    parser.add_argument("--outputs", choices=("local", "lazy", "gather", "dtensor"), default="lazy",
                        help="the ulysses option: compute the logits only when read (the backend's default), "
                             "return each rank's, or gather them in the graph")
    parser.add_argument("--out", default="benchmark", help="writes OUT.json and OUT.png")
    args = parser.parse_args()
    rows = []
    for seq_len in args.seq_lens:
        for world_size in args.world_sizes:
            row = {"P": world_size, "S": seq_len, "threads_per_rank": threads_per_rank(world_size),
                   "outputs": args.outputs, "repeats": args.repeats}
            timings = {config: [] for config in CONFIGURATIONS  # one rank communicates nothing
                       if world_size > 1 or config not in COMPUTE_ONLY}
            for repeat in range(args.repeats):
                for config in timings:
                    log(f"S={seq_len} P={world_size}: timing {config} ({repeat + 1}/{args.repeats}) ...")
                    timings[config].append(on_ranks(config, "time", world_size, seq_len, args.steps, args.outputs))
                    log(f"  {timings[config][-1]['seconds']:.2f} s/step")
            for config, runs in timings.items():
                row[config] = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
                row[config]["seconds_per_repeat"] = [run["seconds"] for run in runs]
            for config in ("one", "ulysses", "deepspeed"):
                log(f"S={seq_len} P={world_size}: peak memory of {config} ...")
                row[config]["peak_bytes"] = on_ranks(config, "memory", world_size, seq_len, 2,
                                                     args.outputs)["peak_bytes"]
            row.update(communication(world_size, seq_len))
            rows.append(row)
            print(_line(row), flush=True)
    with open(f"{args.out}.json", "w") as out:
        json.dump(rows, out, indent=2)
    _plot(rows, f"{args.out}.png")
    log(f"wrote {args.out}.json and {args.out}.png")


def _line(row: dict) -> str:
    one, ours, peer, P = row["one"], row["ulysses"], row["deepspeed"], row["P"]
    cores = os.cpu_count() or 1
    shared = f" ({P} ranks share {cores} cores: efficiency at most {cores / P:.2f})" if P > cores else ""
    communicating = ""
    if P > 1:
        ours_free, peer_free = row["ulysses_compute_only"]["seconds"], row["deepspeed_compute_only"]["seconds"]
        communicating = (
            f"; compute only: ulysses {ours_free:.2f} s (efficiency {one['seconds'] / P / ours_free:.2f} if "
            f"communication were free), deepspeed {peer_free:.2f} s; communication costs ulysses "
            f"{ours['seconds'] - ours_free:+.2f} s, deepspeed {peer['seconds'] - peer_free:+.2f} s"
        )
    return (
        f"P={P} S={row['S']}: step one {one['seconds']:.2f} s, ulysses (outputs {row['outputs']}) "
        f"{ours['seconds']:.2f} s, deepspeed "
        f"{peer['seconds']:.2f} s -> ulysses/deepspeed {ours['seconds'] / peer['seconds']:.2f}, parallel efficiency "
        f"{one['seconds'] / P / ours['seconds']:.2f}{shared}{communicating}; peak memory per rank ulysses "
        f"{ours['peak_bytes'] / 2**20:.0f} MiB "
        f"({ours['peak_bytes'] / one['peak_bytes']:.2f} of one), deepspeed {peer['peak_bytes'] / 2**20:.0f} MiB "
        f"({peer['peak_bytes'] / one['peak_bytes']:.2f}); all-to-all {row['all_to_all_calls']} calls "
        f"(formula {row['formula_calls']}; forward {row['all_to_all_by_phase']['forward']}, backward "
        f"{row['all_to_all_by_phase']['backward']}), {row['all_to_all_bytes']:,} B (minimum "
        f"{row['ulysses_minimum_bytes']:,}); collectives (meetings of the ranks) a step: forward "
        f"{row['meetings']['forward']}, backward {row['meetings']['backward']}; "
        f"compile {ours['compile_seconds']:.1f} s, passes {ours['pass_seconds']:.1f} s "
        f"({ours['pass_seconds'] / ours['compile_seconds']:.0%}); input check "
        f"{ours['input_check_seconds'] * 1e3:.2f} ms a call ({ours['input_check_seconds'] / ours['seconds']:.2%} "
        f"of the step); losses one {one['loss']:.6f} ulysses "
        f"{ours['loss']:.6f} deepspeed {peer['loss']:.6f}"
    )


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for world_size in sorted({row["P"] for row in rows}):
        mine = [row for row in rows if row["P"] == world_size]
        lengths = [row["S"] for row in mine]
        for name, style in (("ulysses", "-o"), ("deepspeed", "--s")):
            time_axis.plot(lengths, [row[name]["seconds"] for row in mine], style, label=f"{name} P={world_size}")
            memory_axis.plot(lengths, [row[name]["peak_bytes"] / 2**20 for row in mine], style,
                             label=f"{name} P={world_size}")
        time_axis.plot(lengths, [row["one"]["seconds"] / world_size for row in mine], ":x",
                       label=f"one / {world_size}")
    lengths = sorted({row["S"] for row in rows})
    memory_axis.plot(lengths, [next(r["one"]["peak_bytes"] for r in rows if r["S"] == s) / 2**20 for s in lengths],
                     ":xk", label="one process")
    time_axis.set(xlabel="sequence length S", ylabel="seconds per step (fwd+bwd)", xscale="log", yscale="log")
    memory_axis.set(xlabel="sequence length S", ylabel="peak MiB per rank during a step", xscale="log")
    for axis in (time_axis, memory_axis):
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
