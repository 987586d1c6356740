"""A transformers Llama wrapped by PEFT (LoRA on the attention and MLP projections)
compiles with the backend unchanged: parallelized (a site per layer and its all-to-alls), loss, logits
and every adapter gradient equal eager's on the same inputs, the base weights stay
frozen, and ``save_pretrained`` writes an adapter-only checkpoint that PEFT loads on one process."""

from __future__ import annotations

import copy

import pytest
import torch

from models import token_batch, tiny_llama
from multirank import assert_close, run_ranks

pytestmark = pytest.mark.multirank

LAYERS = 2


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])
    return get_peft_model(tiny_llama(layers=LAYERS), config)


def lora_trains_like_eager(rank, world_size, stage, folder):
    import pathlib

    from peft import PeftModel

    from ulysses_compile import full_state_dict, parallelize, save_pretrained

    model = _lora_llama()
    reference = copy.deepcopy(model)
    compiled = parallelize(model, zero_stage=stage, compiler="aot_eager", dump_dir=folder)
    trainable = [name for name, param in compiled.named_parameters() if param.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    optimizer = torch.optim.SGD([p for p in compiled.parameters() if p.requires_grad], lr=0.5)
    reference_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    where = f"rank {rank} P={world_size} stage {stage}"
    for step in range(2):
        ids, labels = token_batch(seq=64, seed=step + 1)
        got = compiled(input_ids=ids, labels=labels, use_cache=False)
        got.loss.backward()
        want = reference(input_ids=ids, labels=labels, use_cache=False)
        want.loss.backward()
        assert_close(f"{where} step {step} loss", got.loss, want.loss)
        assert_close(f"{where} step {step} logits", got.logits, want.logits)
        for name, param in compiled.named_parameters():
            want_grad = reference.get_parameter(name.removeprefix("_orig_mod.")).grad
            if not param.requires_grad:
                assert param.grad is None and want_grad is None, f"{where}: frozen {name} got a gradient"
                continue
            grad = param.grad.full_tensor() if stage else param.grad
            assert_close(f"{where} step {step} grad {name}", grad, want_grad)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    (report,) = pathlib.Path(folder, f"rank{rank}").glob("*/report.txt")
    text = report.read_text()
    assert f"attention sites: {LAYERS}" in text and f"seq_to_heads_qkv x{LAYERS}" in text, text
    assert f"heads_to_seq x{LAYERS}" in text and "seq_to_heads x" not in text, text

    trained = full_state_dict(compiled)
    save_pretrained(compiled, pathlib.Path(folder, "adapter"))
    saved = sorted(p.name for p in pathlib.Path(folder, "adapter").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved, saved
    loaded = PeftModel.from_pretrained(tiny_llama(layers=LAYERS), pathlib.Path(folder, "adapter"))
    for name, tensor in loaded.state_dict().items():
        assert_close(f"{where} loaded {name}", tensor, trained[name])


@pytest.mark.parametrize("world_size,stage", [(2, 0), pytest.param(4, 3, marks=pytest.mark.slow)])
def test_lora_trains_like_eager_and_saves_the_adapter(world_size, stage, tmp_path):
    run_ranks(lora_trains_like_eager, world_size, stage, str(tmp_path))
