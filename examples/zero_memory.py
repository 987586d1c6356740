"""Per-rank bytes of parameters, gradients and AdamW state under ``parallelize`` at each ZeRO stage,
against one device holding everything, after one training step on P CPU ranks.

    python examples/zero_memory.py                  # P = 2
    python examples/zero_memory.py --world-size 4

The bytes are counted from the tensors each rank holds (``model.parameters()``, their ``.grad`` and the
optimizer's state), so they are exact; the ideal at every stage here is 1/P, because every stage
stores shards (stage 3 differs in re-gathering parameters in the backward, which shows in activation
memory, not here).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from demo import batch, build_model


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def held_bytes(model, optimizer) -> tuple[int, int, int]:
    params = list(model.parameters())
    state = [value for per_param in optimizer.state.values() for value in per_param.values()]
    return _bytes(params), _bytes(p.grad for p in params), _bytes(state)


def one_step(model, seq_len: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**batch(0, seq_len)).loss.backward()
    optimizer.step()
    return held_bytes(model, optimizer)


def run(rank: int, world_size: int, port: int, seq_len: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import ulysses_compile

    single = one_step(build_model(), seq_len)
    rows = []
    for stage in (0, 1, 2, 3):
        model = ulysses_compile.parallelize(build_model(), zero_stage=stage, options={"compiler": "aot_eager"})
        rows.append((stage, one_step(model, seq_len)))
    if rank == 0:
        print(f"P = {world_size}, S = {seq_len}; bytes held by rank 0 after one AdamW step "
              f"(ratio to one device; ideal 1/P = {1 / world_size:.3f})")
        print(f"{'stage':>5} {'parameters':>20} {'gradients':>20} {'AdamW state':>20}")
        print(f"{'1 dev':>5} " + " ".join(f"{held:>20,}" for held in single))
        for stage, held in rows:
            print(f"{stage:>5} " + " ".join(f"{h:>11,} ({h / s:.3f})" for h, s in zip(held, single)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run, args=(args.world_size, port, args.seq_len), nprocs=args.world_size,
                       start_method="spawn")


if __name__ == "__main__":
    main()
