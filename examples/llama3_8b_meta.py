"""A Llama-3-8B configuration at 128K tokens, built on the meta device: nothing of its 16 GB of bf16
weights is allocated, and ``explain`` plans it on fake tensors.

    python -m ulysses_compile explain examples/llama3_8b_meta.py:make --world-size 8
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 131072


def make():
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=SEQ_LEN,
                         rope_theta=500000.0, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        ids = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    return model, (), {"input_ids": ids, "labels": ids}
