"""What the checks against eager cost in a training step, on P CPU ranks.

    python examples/verify_cost.py                       # P = 2, S = 4096
    python examples/verify_cost.py --world-size 4 --seq-len 8192

``options={"verify": "short"}`` runs the compiled program and the captured graph eagerly, once, on a
short sequence (the call's length class: ``S mod P`` kept, at least ``2P``), forward and backward, before
the first call runs; ``verify=True`` runs the captured graph eagerly at the call's length ``S`` on every
rank, which is the one-device step sequence parallelism exists to avoid. For the Llama of
``zero_memory.py`` (vocab 8192, hidden 256, 4 layers) compiled with ``dynamic=True``, each rank measures:

- the first call (compilation and one training step) without a check and with ``verify="short"``: time
  and peak resident memory above the start (Linux ``VmHWM``); the check's own seconds (from its log
  record) and the difference of the two peaks are its cost, paid once;
- a training step after that (what every later call costs, with or without the check);
- the eager forward at ``S`` that ``verify=True`` adds (time and peak), for comparison.

Every row shows the largest figure over the ranks.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist

from zero_memory import batch, build_model, launch, peak_bytes


def timed(step) -> tuple[float, int]:
    """Seconds and peak resident bytes of ``step()``."""
    started = time.perf_counter()
    peak = peak_bytes(step)
    return time.perf_counter() - started, peak


class CheckSeconds(logging.Handler):
    """The seconds each ``verify="short"`` check took, from its log record."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seconds = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "verify_seconds"):
            self.seconds.append(record.verify_seconds)


def first_and_next(inputs, args, verify) -> tuple[tuple[float, int], tuple[float, int]]:
    torch.compiler.reset()
    compiled = torch.compile(build_model(args.seq_len), backend="ulysses", dynamic=True,
                             options={"compiler": args.compiler, "verify": verify})
    step = lambda: compiled(**inputs).loss.backward()  # noqa: E731
    return timed(step), timed(step)


def run(rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from ulysses_compile.core.collectives import gather_objects

    inputs = batch(args.seq_len)
    first, step = first_and_next(inputs, args, False)
    checks = CheckSeconds()
    logger = logging.getLogger("ulysses_compile")
    logger.addHandler(checks)
    logger.setLevel(logging.INFO)
    first_checked, step_checked = first_and_next(inputs, args, "short")
    model = build_model(args.seq_len)
    with torch.no_grad():
        eager = timed(lambda: model(**inputs))
    rows = {"first call, no check": first, "first call, verify='short'": first_checked,
            "the check itself (its log record)": (sum(checks.seconds), first_checked[1] - first[1]),
            "later step, no check": step, "later step, verify='short'": step_checked,
            "verify=True adds: eager forward at S": eager}
    every_rank = gather_objects(rows, dist.group.WORLD)
    if rank == 0:
        print(f"P = {world_size}, S = {args.seq_len}, compiler {args.compiler}, dynamic=True: the most any "
              f"rank takes (seconds, peak resident memory above the start)")
        for name in rows:
            seconds = max(ranks[name][0] for ranks in every_rank)
            peak = max(ranks[name][1] for ranks in every_rank)
            print(f"{name:>38} {seconds:>8.2f} s {peak / 2**20:>9.1f} MiB")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--compiler", default="aot_eager", choices=("inductor", "aot_eager"))
    launch(run, parser.parse_args())


if __name__ == "__main__":
    main()
