"""What only a GPU shows: bf16 kernels, FlexAttention's backward under Inductor, flash-attn where present.

Outside the default suite (marker ``gpu``); ``scripts/gpu_check.sh`` runs them on a GPU machine. One
process on one GPU is a group of one (NCCL, with gloo for CPU tensors): the kernels run for real, the
collectives between ranks are the multi-rank tests' job. ``ULYSSES_GPU_TEST_DEVICE=cpu`` runs the same
comparisons on CPU, to check the tests themselves where no GPU is at hand (FlexAttention has no CPU
backward: that one fails there).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from models import token_batch

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("ULYSSES_GPU_TEST_DEVICE", "cuda")


@pytest.fixture
def group_of_one():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device: run them on a GPU machine (bash scripts/gpu_check.sh), or "
                    "set ULYSSES_GPU_TEST_DEVICE=cpu to check them on CPU")
    if dist.is_initialized():
        dist.destroy_process_group()
    backend = "cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    torch.compiler.reset()
    yield
    dist.destroy_process_group()
    torch.compiler.reset()


def llama(attention: str, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).to(DEVICE, dtype)


def assert_step_matches_eager(model: LlamaForCausalLM, rtol: float) -> None:
    """Loss and every parameter gradient of one step, compiled with Inductor, against eager; ``rtol`` of
    each reference's largest magnitude."""
    reference = copy.deepcopy(model)
    ids, labels = (t.to(DEVICE) for t in token_batch(seq=256))
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "inductor"})
    loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    want = reference(input_ids=ids, labels=labels, use_cache=False).loss
    want.backward()
    torch.testing.assert_close(loss.float(), want.float(), rtol=rtol, atol=rtol * want.abs().item())
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        scale = expected[name].grad.abs().max().item()
        torch.testing.assert_close(param.grad.float(), expected[name].grad.float(), rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.usefixtures("group_of_one")
def test_bfloat16_training_step_matches_eager():
    # bf16 keeps 8 bits of mantissa: Inductor's fused kernels round differently from eager's
    assert_step_matches_eager(llama("sdpa", torch.bfloat16), rtol=5e-2)


@pytest.mark.usefixtures("group_of_one")
def test_flex_attention_backward_under_inductor_matches_eager():
    assert_step_matches_eager(llama("flex_attention", torch.float32), rtol=1e-4)


@pytest.mark.usefixtures("group_of_one")
def test_flash_attention_2_matches_eager_where_installed():
    pytest.importorskip("flash_attn", reason="flash-attn is not installed on this machine")
    assert_step_matches_eager(llama("flash_attention_2", torch.bfloat16), rtol=5e-2)
