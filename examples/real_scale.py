"""One rank's program of a real-size long-context job, alone in one process: rank 0 of P on torch's
fake process group (collectives return tensors of the right shapes and move nothing), so one device
measures what one rank of the job computes and holds, beside what ``explain`` plans for it.

    python examples/real_scale.py                              # tiny, on CPU: the same program, in seconds
    python examples/real_scale.py --size 350m                  # a 350M Llama, 8K tokens, P = 8, on CPU (~5 min)
    python examples/real_scale.py --size 8b --device cuda      # Llama-3-8B, 128K tokens, P = 8, one GPU

The job: a transformers Llama, one sequence of ``--seq-len`` tokens over ``--world-size`` ranks (8), so
this rank runs S/P tokens and holds its ZeRO shard (``--zero-stage``, 3) of the parameters (fp32; at
``--size 8b`` gathered in bf16, ``param_dtype``, for bf16 compute), of the gradients and of AdamW's
state; gradient checkpointing on every decoder layer; Inductor (``--compiler``). On CUDA only SDPA's
flash kernel is enabled (the math and memory-efficient ones are switched off), so attention runs flash
attention or the step fails; ``--attention flash_attention_2`` uses the flash-attn package instead.

It prints and writes (``--out``, JSON): the compile time (the first step less a later one), the
median step time, the collectives a step calls (torch's profiler) beside those ``explain`` lists
(in the programs, and once Inductor buckets them), what the rank holds, and the peak memory of a step beside
``explain``'s estimate of it, planned on the meta device for the same rank and options. The peak is
the most bytes of tensors alive at once (CUDA: ``max_memory_allocated``; CPU: torch's profiler's
allocation events) with the parameters and AdamW state the rank holds. The values the fake
collectives return are not the job's, so neither is the loss; the work and the memory are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM
from zero_memory import _bytes, collectives_by_kind

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=1024),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=8192),
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
DEFAULT_SEQ_LEN = {"tiny": 1024, "small": 4096, "350m": 8192, "8b": 131072}
# the gathered parameters' dtype: bf16 where the job computes in bf16 (on a GPU), the default elsewhere
PARAM_DTYPE = {"tiny": None, "small": None, "350m": None, "8b": torch.bfloat16}


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


def zero_options(args) -> dict:
    dtype = PARAM_DTYPE[args.size]
    return {"zero_stage": args.zero_stage, "param_dtype": dtype, "reduce_dtype": dtype and torch.float32}


def planned(size: str, seq_len: int | None = None, attention: str = "sdpa"):
    """The job's model and batch on the meta device (nothing allocated), as ``explain`` plans them."""
    seq_len = seq_len or DEFAULT_SEQ_LEN[size]
    model = build_model(size, seq_len, attention, "meta")
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}


def tiny(seq_len: int = DEFAULT_SEQ_LEN["tiny"]):
    """``python -m ulysses_compile explain examples/real_scale.py:tiny -P 8 --zero-stage 3``"""
    return planned("tiny", seq_len)


def llama_350m(seq_len: int = DEFAULT_SEQ_LEN["350m"]):
    """``python -m ulysses_compile explain examples/real_scale.py:llama_350m -P 8 --zero-stage 3 --max-memory 24GiB``"""
    return planned("350m", seq_len)


def llama_8b(seq_len: int = DEFAULT_SEQ_LEN["8b"]):
    """``python -m ulysses_compile explain examples/real_scale.py:llama_8b -P 8 --zero-stage 3 --param-dtype
    bfloat16 --reduce-dtype float32 --max-memory 80GiB``: the job of ``--size 8b``"""
    return planned("8b", seq_len)


def estimate(args) -> dict:
    """``explain``'s plan of the same rank's step."""
    from ulysses_compile import explain

    model, _, batch = planned(args.size, args.seq_len, args.attention)
    report = explain(model, **batch, world_size=args.world_size, rank=0, options={"compiler": args.compiler},
                     **zero_options(args))
    figures = report.memory.at()
    bucketed = Counter()
    for (_, kind), count in report.calls_under_inductor.items():
        bucketed[kind] += count
    return {"estimated_peak_bytes": figures.peak, "estimated_peak_in": figures.peak_in,
            "explained_collectives_per_step": dict(Counter(call.kind for call in report.collectives)),
            "explained_calls_under_inductor": dict(bucketed)}


def measure(args) -> dict:
    from ulysses_compile import parallelize
    from ulysses_compile.core.compat import live_bytes_peak, register_fake_backend

    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=args.world_size)
    cuda = args.device == "cuda"
    if cuda:
        only_flash_attention()
    model = parallelize(build_model(args.size, args.seq_len, args.attention, args.device), compiler=args.compiler,
                        **zero_options(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SIZES[args.size]["vocab_size"], (1, args.seq_len), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    def timed() -> float:
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        step()
        return time.perf_counter() - started

    first = timed()
    seconds = statistics.median(timed() for _ in range(args.steps))
    params = list(model.parameters())
    state = [value for per_param in optimizer.state.values() for value in per_param.values()]
    optimizer.zero_grad(set_to_none=True)
    held = _bytes(params) + _bytes(state)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated()
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
            step()
        peak = held + live_bytes_peak(profiled)
    figures = {"parameters": _bytes(params), "gradients": _bytes(p.grad for p in params),
               "optimizer_state": _bytes(state), "whole_parameters": sum(p.numel() * p.element_size() for p in params),
               "collectives_per_step": dict(collectives_by_kind(step))}
    dist.destroy_process_group()
    return {"size": args.size, "seq_len": args.seq_len, "world_size": args.world_size,
            "tokens_per_rank": args.seq_len // args.world_size, "device": args.device,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu", "attention": args.attention,
            "zero_stage": args.zero_stage, "compiler": args.compiler, "compile_seconds": first - seconds, "step_seconds": seconds,
            "measured_peak_bytes": peak, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--seq-len", type=int, help=f"global tokens (default: {DEFAULT_SEQ_LEN})")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--attention", choices=("sdpa", "flash_attention_2"), default="sdpa")
    parser.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=3)
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the compiling one")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    args.seq_len = args.seq_len or DEFAULT_SEQ_LEN[args.size]
    figures = {**estimate(args), **measure(args)}
    mib = 2**20
    compute = "bf16" if PARAM_DTYPE[args.size] else "fp32"
    print(f"{figures['size']} on {figures['device_name']}, rank 0 of {figures['world_size']}: "
          f"{figures['tokens_per_rank']} of {figures['seq_len']} tokens, ZeRO-{args.zero_stage}, {compute} compute, checkpointing, "
          f"{figures['attention']}, {figures['compiler']}")
    print(f"compile {figures['compile_seconds']:.1f} s, step {figures['step_seconds']:.2f} s; collectives a step "
          f"{figures['collectives_per_step']} (explain lists {figures['explained_collectives_per_step']}, "
          f"{figures['explained_calls_under_inductor']} once Inductor buckets them)")
    print(f"held between steps: parameters {figures['parameters'] / mib:,.1f} MiB (of "
          f"{figures['whole_parameters'] / mib:,.1f}), AdamW state {figures['optimizer_state'] / mib:,.1f} MiB; "
          f"gradients after the step {figures['gradients'] / mib:,.1f} MiB")
    measured, estimated = figures["measured_peak_bytes"], figures["estimated_peak_bytes"]
    print(f"peak of a step: measured {measured / mib:,.1f} MiB, explain's estimate {estimated / mib:,.1f} MiB "
          f"({estimated / measured - 1:+.1%}; its peak in {figures['estimated_peak_in']})")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
