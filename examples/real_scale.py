"""One rank's program of a real-size long-context job, alone in one process: rank 0 of P on torch's
fake process group (collectives return tensors of the right shapes and move nothing), so one device
measures what one rank of the job computes and holds.

    python examples/real_scale.py                              # tiny, on CPU: the same program, in seconds
    python examples/real_scale.py --size 8b --device cuda      # Llama-3-8B, 128K tokens, P = 8, one GPU

The job: a transformers Llama (``--size 8b``: Llama-3-8B's shape, bf16 compute), one sequence of
``--seq-len`` tokens (128K) over ``--world-size`` ranks (8), so this rank runs 16K tokens and holds
its ZeRO-3 shard of the parameters (fp32, gathered in bf16: ``param_dtype``), of the gradients and of
AdamW's state; gradient checkpointing on every decoder layer; Inductor. On CUDA only SDPA's flash
kernel is enabled (the math and memory-efficient ones are switched off), so attention runs flash
attention or the step fails; ``--attention flash_attention_2`` uses the flash-attn package instead.

It prints and writes (``--out``, JSON): the compile time (the first step less a later one), the
median step time, the peak memory of a step (CUDA: ``max_memory_allocated``; CPU: the process's peak
resident memory above its start) beside the bytes of parameters, gradients and optimizer state the
rank holds, and the collectives a step calls (torch's profiler). The values the fake collectives
return are not the job's, so neither is the loss; the work and the memory are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from zero_memory import _bytes, collectives_by_kind, peak_bytes

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=1024),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
DEFAULT_SEQ_LEN = {"tiny": 1024, "8b": 131072}


def build_model(size: str, seq_len: int, attention: str, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=seq_len, attn_implementation=attention, **SIZES[size])
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def only_flash_attention() -> None:
    torch.backends.cuda.enable_math_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def measure(args) -> dict:
    from ulysses_compile import parallelize
    from ulysses_compile.compat import register_fake_backend

    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=args.world_size)
    cuda = args.device == "cuda"
    if cuda:
        only_flash_attention()
    model = parallelize(build_model(args.size, args.seq_len, args.attention, args.device), zero_stage=3,
                        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SIZES[args.size]["vocab_size"], (1, args.seq_len), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    def timed() -> float:
        started = time.perf_counter()
        step()
        return time.perf_counter() - started

    first = timed()
    seconds = statistics.median(timed() for _ in range(args.steps))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = peak_bytes(step)
    params = list(model.parameters())
    state = [value for per_param in optimizer.state.values() for value in per_param.values()]
    held = {"parameters": _bytes(params), "gradients": _bytes(p.grad for p in params),
            "optimizer_state": _bytes(state), "whole_parameters": sum(p.numel() * p.element_size() for p in params),
            "collectives_per_step": dict(collectives_by_kind(step))}
    dist.destroy_process_group()
    return {"size": args.size, "seq_len": args.seq_len, "world_size": args.world_size,
            "tokens_per_rank": args.seq_len // args.world_size, "device": args.device,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu", "attention": args.attention,
            "compile_seconds": first - seconds, "step_seconds": seconds, "step_peak_bytes": peak, **held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--seq-len", type=int, help="global tokens (default: 1024 tiny, 131072 8b)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--attention", choices=("sdpa", "flash_attention_2"), default="sdpa")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the compiling one")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    args.seq_len = args.seq_len or DEFAULT_SEQ_LEN[args.size]
    figures = measure(args)
    mib = 2**20
    print(f"{figures['size']} on {figures['device_name']}, rank 0 of {figures['world_size']}: "
          f"{figures['tokens_per_rank']} of {figures['seq_len']} tokens, ZeRO-3, bf16 compute, checkpointing, "
          f"{figures['attention']}")
    print(f"compile {figures['compile_seconds']:.1f} s, step {figures['step_seconds']:.2f} s, "
          f"collectives a step {figures['collectives_per_step']}; step peak {figures['step_peak_bytes'] / mib:,.1f} MiB "
          f"over what the rank holds: parameters {figures['parameters'] / mib:,.1f} MiB (of "
          f"{figures['whole_parameters'] / mib:,.1f}), gradients {figures['gradients'] / mib:,.1f} MiB, "
          f"AdamW state {figures['optimizer_state'] / mib:,.1f} MiB")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
