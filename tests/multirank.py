"""Run a function on P real gloo ranks (spawned processes) and compare results with eager."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RTOL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> None:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; re-raise any failure."""
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True,
                       start_method="spawn")


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> float:
    """Max abs error must be within ``rtol`` of the reference's largest magnitude."""
    assert got is not None, f"{name}: missing (no gradient?)"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got64, want64 = got.detach().double(), want.detach().double()
    error = (got64 - want64).abs().max().item() if want.numel() else 0.0
    scale = want64.abs().max().item() if want.numel() else 0.0
    assert error <= rtol * scale + 1e-8, f"{name}: max abs error {error:.3e} > {rtol} x {scale:.3e}"
    return error


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
