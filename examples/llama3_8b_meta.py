"""A Llama-3-8B configuration at 128K tokens, built on the meta device: nothing of its 16 GB of bf16
weights is allocated, and ``explain`` plans it on fake tensors.

    python -m ulysses_compile explain examples/llama3_8b_meta.py:make --world-size 8 --zero-stage 3
    python -m ulysses_compile explain examples/llama3_8b_meta.py:make -P 8 --zero-stage 3 --max-memory 80GiB

The second traces with a symbolic length and adds the longest sequence whose step fits in 80 GiB per
rank (``--seq-len N`` plans at another length).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 131072


def make(seq_len: int = SEQ_LEN):
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=max(seq_len, SEQ_LEN),
                         rope_theta=500000.0, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}
