"""Run a function on P real gloo ranks and compare results with eager.

The ranks are spawned once per world size and serve every test that asks for that many (importing
torch and transformers and starting a process group take a 4-rank spawn about 10 s on 2 cores, and the
suite runs about twenty). A failure, a dead rank or a timeout closes that pool; the next test starts a
new one.
"""

from __future__ import annotations

import atexit
import copy
import os
import queue
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

RTOL = 1e-4
TIMEOUT_S = 900  # one test's work on every rank; beyond it a rank is taken to hang in a collective
GRACE_S = 10  # after one rank fails, how long the others get to report their own error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, world_size, port, tasks, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while (task := tasks.get()) is not None:
        fn, args = task
        torch.compiler.reset()
        torch._dynamo.utils.counters.clear()
        try:
            fn(rank, world_size, *args)
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


class _RankPool:
    def __init__(self, world_size: int):
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(target=_serve, args=(rank, world_size, port, self.tasks[rank], self.results), daemon=True)
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def run(self, fn, args) -> None:
        """Run ``fn(rank, world_size, *args)`` on every rank; raise with every failing rank's traceback."""
        for tasks in self.tasks:
            tasks.put((fn, args))
        errors: dict[int, str] = {}
        done: set[int] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while len(done) < self.world_size and time.monotonic() < deadline:
            try:
                rank, error = self.results.get(timeout=1)
            except queue.Empty:
                dead = [f"rank {rank} exited with code {p.exitcode}" for rank, p in enumerate(self.processes)
                        if not p.is_alive()]
                if dead:
                    errors[-1] = "; ".join(dead)
                    break
                continue
            done.add(rank)
            if error is not None:
                errors[rank] = error
                deadline = min(deadline, time.monotonic() + GRACE_S)
        if len(done) < self.world_size and not errors:
            errors[-1] = f"ranks {sorted(set(range(self.world_size)) - done)} did not finish within {TIMEOUT_S} s"
        if errors:
            raise AssertionError(
                "\n".join(f"-- rank {rank} --\n{error}" if rank >= 0 else error
                          for rank, error in sorted(errors.items()))
            )

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.join()


_POOLS: dict[int, _RankPool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_ranks(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise any failure."""
    pool = _POOLS.get(world_size) or _POOLS.setdefault(world_size, _RankPool(world_size))
    try:
        pool.run(fn, args)
    except BaseException:
        _POOLS.pop(world_size).close()
        raise


def torchrun(script, ranks: int, *arguments: str) -> None:
    """Launch ``script`` as a user would, ``torchrun --nproc-per-node RANKS script ARGUMENTS``."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", str(script), *arguments]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-6000:]


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> float:
    """Max abs error must be within ``rtol`` of the reference's largest magnitude (a DTensor output of the
    compiled model is compared whole)."""
    assert got is not None, f"{name}: missing (no gradient?)"
    if isinstance(got, DTensor):
        got = got.full_tensor()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got64, want64 = got.detach().double(), want.detach().double()
    error = (got64 - want64).abs().max().item() if want.numel() else 0.0
    scale = want64.abs().max().item() if want.numel() else 0.0
    assert error <= rtol * scale + 1e-8, f"{name}: max abs error {error:.3e} > {rtol} x {scale:.3e}"
    return error


def step_against_eager(rank, model, *args, **kwargs) -> list:
    """One forward and backward of ``model`` compiled with ulysses (aot_eager) and of an eager copy on
    the same inputs; loss, logits and every gradient compared. Returns the compiled graphs' reports.
    ``model`` returns ``(loss, logits)`` or an output with ``.loss`` and ``.logits``."""
    from graphs import reporting_backend

    reference = copy.deepcopy(model)
    reports = []
    got = torch.compile(model, backend=reporting_backend(reports))(*args, **kwargs)
    want = reference(*args, **kwargs)
    (got_loss, got_logits), (want_loss, want_logits) = (
        (out.loss, out.logits) if hasattr(out, "loss") else out for out in (got, want))
    got_loss.backward()
    want_loss.backward()
    compare_model(rank, model, reference, {"loss": (got_loss, want_loss), "logits": (got_logits, want_logits)})
    return reports


def compare_model(rank, compiled_module, eager_module, outputs) -> dict[str, float]:
    """Compare outputs (name -> (got, want)) and every parameter gradient; returns the errors."""
    errors = {}
    for name, (got, want) in outputs.items():
        errors[name] = assert_close(f"rank {rank} {name}", got, want)
    eager_params = dict(eager_module.named_parameters())
    for name, param in compiled_module.named_parameters():
        if eager_params[name].grad is None and param.grad is None:
            continue
        errors[f"grad {name}"] = assert_close(f"rank {rank} grad {name}", param.grad, eager_params[name].grad)
    assert any(k.startswith("grad ") for k in errors), "no gradient was compared"
    return errors
