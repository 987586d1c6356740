"""What the ranks' agreement checks cost, in one process (a fake process group of 2 ranks):

    python examples/agreement_cost.py

- the module-state check each compiled graph runs at its first call (``agreement.agree_on_module_state``:
  a digest of every parameter's and buffer's bits, one all-gather) on a 380M-parameter Llama;
- the per-call input check's fingerprint (``agreement.InputCheck``) of a [1, 4096] batch of token ids
  and of [1, 4096, 1024] ``inputs_embeds``.

Each is the median of three runs after a warm-up, on this machine's threads.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_compile.agreement import _fingerprint, agree_on_module_state
from ulysses_compile.core.compat import register_fake_backend


def seconds(work) -> float:
    work()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                         num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8))
    state = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    parameters = sum(p.numel() for p in model.parameters())
    state_s = seconds(lambda: agree_on_module_state(state, dist.group.WORLD, 0, False, "agreement_cost"))
    ids = torch.randint(0, 32000, (1, 4096))
    embeds = torch.randn(1, 4096, 1024)
    print(f"{torch.get_num_threads()} threads")
    print(f"module state, {parameters / 1e6:.0f}M parameters in {len(state)} tensors: {state_s:.3f} s per compiled graph")
    print(f"input fingerprint, ids [1, 4096]: {seconds(lambda: _fingerprint(ids)) * 1e3:.2f} ms per call")
    print(f"input fingerprint, inputs_embeds [1, 4096, 1024]: {seconds(lambda: _fingerprint(embeds)) * 1e3:.1f} ms per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
