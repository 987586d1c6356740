"""Tiny real models (no downloads) and their inputs, shared by the tests."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 128


def tiny_llama(heads: int = 8, kv_heads: int = 4, layers: int = 2, seed: int = 0,
               intermediate_size: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=intermediate_size or 16 * heads,
        num_hidden_layers=layers,
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


def tiny_t5(seed: int = 0):
    """An encoder-decoder with T5's relative position bias; its decoder inputs are the labels shifted
    right by the model itself, written into a new tensor in place."""
    import transformers as t

    torch.manual_seed(seed)
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


def tiny_deepseek_v3(seed: int = 0):
    """Multi-head latent attention (low-rank q and kv, rotary and plain head parts written into a new
    tensor in place, value head dim below the query's) and group-limited MoE with a shared expert."""
    import transformers as t

    torch.manual_seed(seed)
    return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64))


def _causal(config_cls, model_cls, **overrides):
    def make():
        torch.manual_seed(0)
        fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
        fields.update(overrides)
        return model_cls(config_cls(**{k: v for k, v in fields.items() if v is not None}))

    return make


def _encoder(config_cls, model_cls, **overrides):
    def make():
        torch.manual_seed(0)
        return model_cls(config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                    **overrides))

    return make


def model_zoo() -> dict:
    """Unmodified transformers models from tiny configs: name -> (factory, kind of inputs)."""
    import transformers as t

    return {
        "qwen2": (_causal(t.Qwen2Config, t.Qwen2ForCausalLM), "causal"),
        "mistral": (_causal(t.MistralConfig, t.MistralForCausalLM), "causal"),
        "qwen3": (_causal(t.Qwen3Config, t.Qwen3ForCausalLM, head_dim=16), "causal"),
        "gemma": (_causal(t.GemmaConfig, t.GemmaForCausalLM, head_dim=16), "causal"),
        # Local layers whose window (8) is shorter than the sequence: the mask is built from position ids.
        "gemma3_sliding": (_causal(t.Gemma3TextConfig, t.Gemma3ForCausalLM, head_dim=16, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"]), "causal"),
        # A global layer and a local one (window 8 < S), the mask applied by torch.where between the products.
        "gpt_neo_local": (_causal(t.GPTNeoConfig, t.GPTNeoForCausalLM, num_key_value_heads=None, intermediate_size=None,
                                  attention_types=[[["global", "local"], 1]], window_size=8, embed_dropout=0.0,
                                  attention_dropout=0.0, resid_dropout=0.0), "causal"),
        "gemma2_softcap": (_causal(t.Gemma2Config, t.Gemma2ForCausalLM, head_dim=16, attn_implementation="eager",
                                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0), "causal"),
        # Learned per-head sink logits joined to the scores (the router's top-k is gathered: issue 21).
        "gpt_oss_sinks": (_causal(t.GptOssConfig, t.GptOssForCausalLM, head_dim=16, attn_implementation="eager",
                                  num_local_experts=4, num_experts_per_tok=2), "causal"),
        "phi3": (_causal(t.Phi3Config, t.Phi3ForCausalLM, pad_token_id=0), "causal"),
        "gpt_neox": (_causal(t.GPTNeoXConfig, t.GPTNeoXForCausalLM, num_key_value_heads=None), "causal"),
        "opt": (_causal(t.OPTConfig, t.OPTForCausalLM, intermediate_size=None, num_key_value_heads=None, ffn_dim=128,
                        dropout=0.0), "causal"),
        "falcon_mqa": (_causal(t.FalconConfig, t.FalconForCausalLM, intermediate_size=None, num_key_value_heads=None,
                               hidden_dropout=0.0, attention_dropout=0.0), "causal"),
        "llama_mqa": (_causal(t.LlamaConfig, t.LlamaForCausalLM, num_key_value_heads=1), "causal"),
        "llama_eager_attention": (_causal(t.LlamaConfig, t.LlamaForCausalLM, attn_implementation="eager"), "causal"),
        "bert_padding": (_encoder(t.BertConfig, t.BertForMaskedLM), "masked"),
        "roberta_padding": (_encoder(t.RobertaConfig, t.RobertaForMaskedLM, pad_token_id=1,
                                     max_position_embeddings=300), "masked"),
        "bert_classifier": (_encoder(t.BertConfig, t.BertForSequenceClassification, num_labels=3), "classify"),
    }


def zoo_inputs(kind: str, seq: int = 32) -> dict:
    ids, labels = token_batch(seq=seq)
    if kind == "causal":
        return {"input_ids": ids, "labels": labels, "use_cache": False}
    mask = torch.ones_like(ids)
    mask[1, seq - 7 :] = 0  # padding at the end of the second sequence
    if kind == "classify":
        labels = torch.tensor([0, 2])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class MeanPooledClassifier(torch.nn.Module):
    """A sequence classifier written plainly: transformer blocks, mean over tokens, a linear head."""

    def __init__(self, classes: int = 3):
        super().__init__()
        import nanogpt

        config = nanogpt.GPTConfig(n_layer=2)
        self.wte = torch.nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = torch.nn.Embedding(config.block_size, config.n_embd)
        self.blocks = torch.nn.ModuleList([nanogpt.Block(config) for _ in range(config.n_layer)])
        self.head = torch.nn.Linear(config.n_embd, classes)

    def forward(self, idx, labels):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=1))
        return logits, torch.nn.functional.cross_entropy(logits, labels)
