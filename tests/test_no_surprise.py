"""No surprise: compiling leaves the user's module and torch's process-wide state as they were, runs
repeat bit for bit, and a long training run does not grow each rank's memory."""

from __future__ import annotations

import copy
import ctypes
import gc
import re

import pytest
import torch

from models import tiny_llama, token_batch
from multirank import run_ranks

pytestmark = pytest.mark.multirank


def _global_state() -> dict:
    """What a backend could change for the whole process."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    def plain(config):  # callables (hooks) compare by identity, which a copy would not keep
        return {k: v for k, v in config.get_config_copy().items() if not callable(v)}

    return {
        "dynamo config": plain(dynamo_config),
        "inductor config": plain(inductor_config),
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "rng": torch.random.get_rng_state(),
    }


def _assert_same_state(before: dict, after: dict) -> None:
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        elif isinstance(value, dict):
            changed = {k: (v, after[key].get(k)) for k, v in value.items() if after[key].get(k) != v}
            assert not changed, f"{key} changed: {changed}"
        else:
            assert value == after[key], f"{key}: {value} -> {after[key]}"


def _hooks(model) -> list[int]:
    return [len(getattr(m, name)) for m in model.modules()
            for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks")]


def module_and_process_untouched(rank, world_size):
    model = tiny_llama(layers=1)
    ids, labels = token_batch()
    state = copy.deepcopy(model.state_dict())
    parameters, hooks, attributes = list(model.parameters()), _hooks(model), set(vars(model))
    before = _global_state()
    compiled = torch.compile(model, backend="ulysses")  # Inductor
    compiled(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    _assert_same_state(before, _global_state())
    plain = tiny_llama(layers=1)  # what torch.compile itself leaves on a module, with any backend
    torch.compile(plain, backend="eager")(input_ids=ids, labels=labels, use_cache=False)
    assert set(vars(model)) - attributes == set(vars(plain)) - attributes
    assert list(model.parameters()) == parameters and _hooks(model) == hooks
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    model.zero_grad()
    eager = model(input_ids=ids, labels=labels, use_cache=False)  # the module itself still runs eagerly
    fresh = tiny_llama(layers=1)(input_ids=ids, labels=labels, use_cache=False)
    assert torch.equal(eager.logits, fresh.logits) and torch.equal(eager.loss, fresh.loss)


def test_compiling_leaves_the_module_and_torch_state_as_they_were():
    run_ranks(module_and_process_untouched, 2)


def _step_results(compiled, model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = compiled(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    return [out.loss.detach(), out.logits.detach()] + [p.grad.clone() for p in model.parameters()]


def repeated_runs_identical(rank, world_size):
    ids, labels = token_batch(seq=30)
    model = tiny_llama(layers=1)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})
    first = _step_results(compiled, model, ids, labels)
    runs = [_step_results(compiled, model, ids, labels) for _ in range(2)]
    torch.compiler.reset()
    again = tiny_llama(layers=1)
    runs.append(_step_results(torch.compile(again, backend="ulysses", options={"compiler": "aot_eager"}), again,
                              ids, labels))
    for run in runs:  # one program (recompiled alike) on the same inputs: determinism is the claim
        assert all(torch.equal(a, b) for a, b in zip(first, run, strict=True))


def test_repeated_runs_are_bitwise_identical():
    run_ranks(repeated_runs_identical, 2)


def _resident_bytes() -> int:
    """Resident memory once glibc has handed back the free pages it keeps for reuse."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+) kB", status.read()).group(1)) * 1024


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def memory_flat_over_steps(rank, world_size):
    """250 AdamW steps: a leak of even 10 KiB per step would show in the resident memory over the last
    100, and a tensor kept alive per step in the count of live tensors (which falls while what earlier
    work left behind is collected)."""
    model = tiny_llama(layers=2)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = token_batch(seq=64)
    resident, tensors = {}, {}
    for step in range(1, 251):
        optimizer.zero_grad()
        compiled(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        optimizer.step()
        if step in (10, 150, 250):
            resident[step], tensors[step] = _resident_bytes(), _live_tensors()
    assert tensors[250] <= tensors[150] <= tensors[10], f"rank {rank}: live tensors after steps 10, 150, 250: {tensors}"
    growth = resident[250] - resident[150]
    assert growth < 2**20, f"rank {rank}: resident memory grew {growth / 2**20:.2f} MiB over steps 150-250"


@pytest.mark.slow
def test_long_training_does_not_grow_memory():
    run_ranks(memory_flat_over_steps, 2)
