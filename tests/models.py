"""Tiny real models (no downloads) and their inputs, shared by the tests."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 128


def tiny_llama(heads: int = 8, kv_heads: int = 4, layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=16 * heads, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(heads: int = 4, layers: int = 2, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=16 * heads, n_layer=layers, n_head=heads, n_positions=512,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(config)


def token_batch(batch: int = 2, seq: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels; the labels ignore a prefix so ranks hold different numbers of valid tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = ids.clone()
    labels[0, : seq * 3 // 8] = -100
    return ids, labels
