"""Per-rank memory under ``parallelize`` at each ZeRO stage and under ``torch.compile`` alone, against one
device, on P CPU ranks.

    python examples/zero_memory.py                  # P = 2
    python examples/zero_memory.py --world-size 4 --seq-len 4096
    python examples/zero_memory.py --checkpointing  # gradient checkpointing on every decoder layer
    python examples/zero_memory.py --model mixtral  # 8 experts, top-2, transformers' grouped experts
    python examples/zero_memory.py --checkpointing --outputs gather    # the logits gathered in the graph
    python examples/zero_memory.py --checkpointing --vocab 32768 --seq-len 8192 --stages 0   # long context

For a Llama of about 7M parameters (vocab 8192, hidden 256, 4 layers; or a Mixtral of the same
proportions with 8 experts of a quarter of the MLP's width) and one global batch, each rank reports,
after a training step with AdamW:

- the bytes of parameters, gradients and AdamW state it holds, counted from the tensors
  (``model.parameters()``, their ``.grad``, the optimizer's state): exact; the ideal at stages 1-3 is 1/P;
- the peak memory of one step (forward, backward, optimizer step; after a warm-up step that compiles):
  the process's peak resident memory above its resident memory when the step starts (Linux
  ``VmHWM``, reset through ``/proc/self/clear_refs``). glibc's allocator is told to return every
  block over 64 KiB at once (``MALLOC_MMAP_THRESHOLD_``), so freed tensors do not linger in it;
- ``explain``'s estimate of that step peak (its peak less the parameters and optimizer state), from
  the same model planned at P ranks in one process, and its error against the measured peak;
- the collectives one step calls on the process group, each a meeting of the ranks (rank 0's, counted
  by torch's profiler in one more step, after the compiler's bucketing: ``--compiler inductor``
  buckets ZeRO's all-gathers and reduce-scatters), and, under Inductor, how many of the step's
  all-gathers its code starts while another is in flight (each layer's prefetched during the one before).

"1 device" is the same step compiled for one rank (a group of one, which the backend compiles as its
inner compiler would); "torch.compile" is the model compiled with ``torch.compile(model,
backend="ulysses")`` and no ``parallelize`` (the README's first flow; ZeRO's stage 0 otherwise). Every
row shows the largest figure over the ranks.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

# glibc's allocator, told to return every block over 64 KiB at once, so freed tensors do not linger in
# it; read when a process starts.
MMAP_THRESHOLD_ENV, MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_", str(64 * 1024)


def build_model(seq_len: int, checkpointing: bool = False, kind: str = "llama", vocab: int = 8192):
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=seq_len)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=172, num_local_experts=8, num_experts_per_tok=2,
                                                 **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=688, **shape))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batch(seq_len: int, vocab: int = 8192) -> dict:
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _bytes(tensors) -> int:
    """What this rank holds of ``tensors`` (a DTensor parameter: its shard)."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if isinstance(t, torch.Tensor))


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1))


def peak_bytes(step) -> int:
    """Peak resident bytes while ``step()`` runs, above the resident bytes at its start."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) restarts from the current resident size
    start = _resident_kib("VmRSS")
    step()
    return (_resident_kib("VmHWM") - start) * 1024


def measured_step(model, optimizer, inputs) -> int:
    """Peak resident bytes of one training step (forward, backward, optimizer step)."""
    optimizer.zero_grad()

    def step():
        model(**inputs).loss.backward()
        optimizer.step()

    return peak_bytes(step)


def collectives_by_kind(step) -> Counter:
    """The process-group collectives ``step()`` calls as it runs (``allgather``, ``alltoall``, ...; each a
    meeting of the ranks), counted by torch's profiler: what a compiled program really does, after any
    compiler's rewrites and bucketing."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    return Counter(re.sub(r"^c10d::|_coalesced|_into_tensor|_base|_$", "", event.name)
                   for event in profile.events() if event.name.startswith("c10d::"))


def collective_calls(model, optimizer, inputs) -> int:
    """The collectives one training step calls on the process group (``collectives_by_kind``)."""
    optimizer.zero_grad()

    def step():
        model(**inputs).loss.backward()
        optimizer.step()

    return sum(collectives_by_kind(step).values())


def collective_schedule(code: str) -> list[tuple[str, str]]:
    """The all-gathers' starts and waits and the all-to-alls in Inductor's generated code, in the order it
    runs them, each named by its buffer: ("start" | "wait" | "all_to_all", buffer)."""
    events = []
    for line in code.splitlines():
        if started := re.search(r"(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into_tensor\.default\("
                                r"|all_gather_into_tensor_out\.default\(.*out=(buf\d+)\)", line):
            events.append(("start", started.group(1) or started.group(2)))
        elif exchanged := re.search(r"(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(", line):
            events.append(("all_to_all", exchanged.group(1)))
        elif (waited := re.search(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)", line)) and any(
                event == "start" and buffer == waited.group(1) for event, buffer in events):
            events.append(("wait", waited.group(1)))
    return events


def overlapped(schedule: list[tuple[str, str]]) -> tuple[int, int]:
    """Of a ``collective_schedule``: the all-gathers started while another is in flight (prefetched), and
    the all-to-alls run while an all-gather is in flight (the layer computing meanwhile)."""
    in_flight, prefetched, hidden = set(), 0, 0
    for event, buffer in schedule:
        if event == "start":
            prefetched += bool(in_flight)
            in_flight.add(buffer)
        elif event == "wait":
            in_flight.discard(buffer)
        else:
            hidden += bool(in_flight)
    return prefetched, hidden


def prefetched_gathers(codes) -> str:
    """All-gathers in Inductor's code (``codes``: forward and backward) and how many of them start while
    another is in flight (prefetched), as "prefetched/all"; "-" when no code was generated."""
    schedules = [collective_schedule(code) for code in codes]
    started = sum(event == "start" for schedule in schedules for event, _ in schedule)
    prefetched = sum(overlapped(schedule)[0] for schedule in schedules)
    return f"{prefetched}/{started}" if codes else "-"


def figures(model, seq_len: int, vocab: int) -> tuple[int, int, int, int, int, str]:
    from ulysses_compile.core.compat import run_and_get_code

    inputs = batch(seq_len, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # compiles; creates the gradients and the optimizer state
    _, codes = run_and_get_code(lambda: model(**inputs).loss.backward())
    optimizer.step()
    peak = measured_step(model, optimizer, inputs)
    params = list(model.parameters())
    state = [value for per_param in optimizer.state.values() for value in per_param.values()]
    return (_bytes(params), _bytes(p.grad for p in params), _bytes(state), peak,
            collective_calls(model, optimizer, inputs), prefetched_gathers(codes))


def run(rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import ulysses_compile
    from ulysses_compile.core.collectives import gather_objects

    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    def model():
        return build_model(args.seq_len, args.checkpointing, args.model, args.vocab)

    rows = {"1 device": figures(ulysses_compile.parallelize(model(), zero_stage=0, group=alone,
                                                            compiler=args.compiler), args.seq_len, args.vocab)}
    bare = torch.compile(model(), backend="ulysses", options={"compiler": args.compiler, "outputs": args.outputs})
    rows["torch.compile"] = figures(bare, args.seq_len, args.vocab)
    for stage in args.stages:
        parallel = ulysses_compile.parallelize(model(), zero_stage=stage, compiler=args.compiler,
                                               outputs=args.outputs)
        rows[f"stage {stage}"] = figures(parallel, args.seq_len, args.vocab)
    every_rank = gather_objects(rows, dist.group.WORLD)
    if rank == 0:
        worst = {name: [max(ranks[name][i] for ranks in every_rank) for i in range(4)] for name in rows}
        calls = {name: every_rank[0][name][4] for name in rows}
        prefetched = {name: every_rank[0][name][5] for name in rows}
        single = worst["1 device"]
        print(f"{args.model} (vocab {args.vocab}), P = {world_size}, S = {args.seq_len}, compiler {args.compiler}, outputs {args.outputs}"
              f"{', activation checkpointing' if args.checkpointing else ''}: the most any rank holds "
              f"after an AdamW step, and its peak memory during one (ratio to one device; 1/P = "
              f"{1 / world_size:.3f})")
        print(f"{'':>13}" + "".join(f"{column:>22}" for column in ("parameters", "gradients", "AdamW state",
                                                                  "step peak")) + f"{'explain estimate':>30}"
              + f"{'collectives':>13}{'gathers prefetched':>20}")
        for name, values in worst.items():
            estimate = args.estimates.get("stage 0" if name == "torch.compile" else name)
            print(f"{name:>13}" + "".join(f"{value / 2**20:>12.1f} MiB ({value / one:.3f})"
                                         for value, one in zip(values, single))
                  + (f"{estimate / 2**20:>12.1f} MiB ({estimate / values[3] - 1:+.1%})" if estimate else f"{'':>30}")
                  + f"{calls[name]:>13}{prefetched[name]:>20}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--compiler", default="aot_eager", choices=("inductor", "aot_eager"))
    parser.add_argument("--checkpointing", action="store_true",
                        help="transformers' gradient checkpointing on every decoder layer (non-reentrant)")
    parser.add_argument("--model", default="llama", choices=("llama", "mixtral"))
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=(0, 1, 2, 3))
    parser.add_argument("--outputs", default="lazy", choices=("lazy", "gather", "dtensor"),
                        help="the ulysses option: the logits gathered when read (the default), gathered in the "
                             "graph, or returned as a DTensor")
    args = parser.parse_args()
    args.estimates = {f"stage {stage}": estimated_step_peak(args, stage) for stage in args.stages}
    launch(run, args)


def estimated_step_peak(args, stage: int) -> int:
    """What ``explain`` estimates for the step peak column: its peak less what is held between steps."""
    import ulysses_compile

    memory = ulysses_compile.explain(build_model(args.seq_len, args.checkpointing, args.model, args.vocab),
                                     world_size=args.world_size, zero_stage=stage,
                                     options={"outputs": args.outputs}, **batch(args.seq_len, args.vocab)).memory.at()
    return memory.peak - memory.parameters - memory.optimizer_state


def launch(run, args) -> None:
    """``run(rank, world_size, port, args)`` on ``args.world_size`` spawned ranks, with the allocator
    setting the peak figures need."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault(MMAP_THRESHOLD_ENV, MMAP_THRESHOLD)
    mp.start_processes(run, args=(args.world_size, port, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
