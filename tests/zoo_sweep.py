"""Every causal LM in the installed transformers, from a tiny config made here, at P gloo ranks against
eager: is each attention parallelized, and is the answer exact?

    .venv/bin/python tests/zoo_sweep.py                      # the full sweep, sdpa and eager, P = 2
    .venv/bin/python tests/zoo_sweep.py --only llama,gpt2 --impl sdpa --table docs/zoo.md

Each architecture runs in its own P processes with a time limit, so a crash or a hang is one row of the
table, not the end of the sweep. A config is shrunk by setting the fields it has (hidden size, layers,
heads, experts, low-rank dims, vocabulary) before its ``__post_init__`` derives the rest (layer types); a
composite config's sub-configs (text, vision, audio towers) are shrunk the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

VOCAB, SEQ, BATCH = 128, 24, 2
TIME_LIMIT_S = 300
MAX_PARAMETERS = 2_000_000
RTOL = 1e-4

SMALL = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 256,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "num_decoder_layers": 2,
    "num_encoder_layers": 2, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "d_model": 64,
    "ffn_dim": 128, "d_ff": 128, "d_kv": 16, "num_heads": 4, "n_positions": 256, "n_ctx": 256,
    "attention_window": 16, "embedding_size": 64, "type_vocab_size": 2, "moe_num_experts": 4,
    "num_shared_experts": 1, "moe_topk": 2, "expert_intermediate_size": 32, "mamba_n_heads": 4,
    "mamba_d_head": 16, "mamba_d_state": 16, "state_size": 16, "ssm_state_size": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "index_head_dim": 16,
    "index_n_heads": 4, "layer_group_size": 2, "full_attn_interval": 2, "attn_layer_period": 2,
    "attn_layer_offset": 1, "mamba_expand": 1, "rotary_dim": 8,
    # The same sizes under the names some models give them.
    "dff": 128, "dim_ff": 128, "dim_head": 16, "swa_head_dim": 16, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2, "mamba_head_dim": 16, "mamba_num_heads": 4, "moe_shared_expert_intermediate_size": 32,
    "unpadded_vocab_size": VOCAB, "hidden_size_global": 64,
    # Vocabularies and ranks of side inputs and low-rank paths (hashed byte n-grams, glyph shapes, loop gates).
    "encoder_hash_byte_group_vocab": 64, "shape_vocab_size": 64, "shape_embed_dim": 16,
    "pronunciation_vocab_size": 64, "pronunciation_embed_dim": 16, "loop_gate_rank": 8,
    "ffn_hidden_size": 128, "d_inner": 128, "first_dense_intermediate_size": 128,
    "mlp_only_intermediate_size": 128, "index_num_heads": 2,  # at most the query heads of one key head
    "num_dense_layers": 1,  # as first_k_dense_replace: one dense layer, then MoE
    # Vision and audio towers of composite models (never run on a text-only batch, but counted).
    "mlp_dim": 128, "output_channels": 16, "num_blocks": 2, "depthwise_separable_out_channel": 64,
    "ext_pw_out_channel": 64, "nemo_conv_channels": 64,
}
# Fields set only where the default uses them: zero means the feature is off (Gemma 4's assistant
# must have no per-layer input embedding), and turning it on would build another model.
SMALL_IF_ON = {
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    # Gemma 3n shares the last 15 of 35 layers' keys and values; at 2 layers, the last one.
    "num_kv_shared_layers": 1, "mamba_d_ssm": 64,
}
# Fields a model needs that the generic rules cannot give it, each with why. Keyed by the model type of
# the config at any depth; a dict given for a sub-config's key is the base that sub-config is shrunk from.
PER_TYPE = {
    # Layer lists that do not follow num_hidden_layers: Zamba's starts with 3 fixed layers, Zamba 2's
    # is a fixed list of 54, GPT-Neo's repeats (global, local) 12 times. One layer of each kind; Zamba
    # ties its later hybrid layers' shared transformer to the first one's, and refuses a tie with none.
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # No default layer_types (the checkpoints give one): a short-convolution layer and an attention one.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # ReformerModelWithLMHead asserts is_decoder (the BERT-like causal LMs only warn, and are left as they
    # were). Its axial position embedding factors the training sequence exactly (4 x 6 = SEQ) and splits
    # hidden_size (32 + 32); its chunks divide SEQ; one local and one LSH layer; a fixed hash seed, else
    # the LSH buckets come from a fresh random rotation on every call.
    "reformer": {"is_decoder": True, "axial_pos_shape": [4, 6], "axial_pos_embds_dim": [32, 32],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "attn_layers": ["local", "lsh"],
                 "hash_seed": 0, "attention_head_size": 16, "feed_forward_size": 128},
    # Its default layout puts the first indexed-attention layer 5th and makes layers 0 and 1 dense: at
    # 2 layers, a sliding layer then an indexed one (its own indexer), dense then MoE.
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1],
                   "kv_source_layers": [0, 1], "mlp_only_layers": [0]},
    # Its shared expert's size (8192). Not in SMALL: GraniteMoE's shared_intermediate_size of 0 means none.
    "ergo": {"shared_intermediate_size": 32},
    # Its config validation allows top-1 routing only.
    "zaya": {"num_experts_per_tok": 1},
    # The attention reads attn_config.rope_theta, which DbrxAttentionConfig lacks unless the checkpoint
    # gives it, and clamps q, k, v with clip_qkv, which fails at its default None: dbrx-instruct's values.
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # The rotary embedding reads rope_parameters per layer type, which the default lacks: one entry for
    # full attention, its M-RoPE sections summing to head_dim / 2 = 8 (the checkpoint's are 24, 20, 20 of 64).
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [4, 2, 2]}}},
    # The full-attention layers' head size is a constructor argument, not a field: 512 by default.
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    # The linear (KDA) attention's head size: 128 by default. Not in SMALL, where Bailing's linear_head_dim
    # would be set too, and Bailing derives its own from head_dim.
    "kimi_linear": {"linear_head_dim": 16},
}
# Causal LMs that no tiny config makes run on this harness's batch (input_ids, labels=input_ids), and why.
NOT_BUILT = {
    "gemma4_assistant": "a speculative-decoding draft model: its forward needs the target model's inputs_embeds "
                        "and shared_kv_states (and its default text_config fails its own validation)",
    "gemma4_unified_assistant": "a speculative-decoding draft model: its forward needs the target model's "
                                "inputs_embeds and shared_kv_states",
    "git": "its loss always drops the first (image_size / patch_size)^2 + 1 logits as image tokens: without "
           "pixel_values, none are left to score",
    "musicgen": "its input_ids are (batch x codebooks, seq) and its labels (batch, seq, codebooks): labels=input_ids "
                "does not fit",
    "musicgen_melody": "its input_ids are (batch x codebooks, seq) and its labels (batch, seq, codebooks): "
                       "labels=input_ids does not fit",
}
# Libraries a model's tower needs to be built at all, where they are not installed.
NEEDS = {"gemma3n": "timm"}  # Gemma3nVisionConfig is a TimmWrapper (MobileNet v5) tower
# Mamba-2 mixers tile the expanded inner size with heads: heads x head size = expand x hidden_size. Where
# the defaults keep that identity, the shrunk config keeps it through its head count.
MAMBA_TILES = (("num_heads", "head_dim", "expand"), ("mamba_num_heads", "mamba_head_dim", "expand"))
# The groups of B and C are shared by whole heads: a group count that does not divide the heads becomes 1.
MAMBA_GROUPS = (("n_groups", "num_heads"), ("n_groups", "mamba_num_heads"))
# Latent attention: the rotary part is the head_dim the rotary embedding is built for.
LATENT = {"num_key_value_heads": SMALL["num_attention_heads"], "head_dim": SMALL["qk_rope_head_dim"],
          "qk_head_dim": SMALL["qk_rope_head_dim"] + SMALL["qk_nope_head_dim"]}
# What the row says when a model runs replicated or refuses, beyond the report's own words.
OUTCOMES = ("parallel, exact", "partly parallel, exact", "replicated with a reason, exact", "refused with an error",
            "not built here", "torch.compile fails without ulysses", "FAILS", "SILENT MISMATCH")


@dataclass
class Row:
    model_type: str
    impl: str
    outcome: str = "FAILS"
    sites: int = 0
    parallel_sites: int = 0
    all_to_alls: int = 0
    gathers: list[str] = field(default_factory=list)
    reason: str = ""
    worst_error: float = 0.0  # max abs error / max magnitude, over loss, logits and every gradient
    seconds: float = 0.0


def causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def tiny_model(model_type: str, impl: str):
    import importlib.util

    import torch
    import transformers

    if model_type in NOT_BUILT:
        raise NotImplementedError(NOT_BUILT[model_type])
    if model_type in NEEDS and importlib.util.find_spec(NEEDS[model_type]) is None:
        raise ImportError(f"it needs the {NEEDS[model_type]} library, which is not installed")
    model_class = getattr(transformers, causal_lm_types()[model_type])
    defaults = transformers.AutoConfig.for_model(model_type)
    config = None
    # A causal LM built on one part of a composite config (Llama4ForCausalLM on the text_config of
    # Llama4Config) is built from that part alone, shrunk from the defaults the composite gives it.
    specs = getattr(type(defaults), "sub_configs_defaults", None) or {}
    for key, value in vars(defaults).items():
        if type(value) is getattr(model_class, "config_class", None):
            config = tiny_config(type(value), value.model_type, getattr(specs.get(key), "init_kwargs", None))
    config = config or tiny_config(type(defaults), model_type)
    config._attn_implementation = attention_of(model_class, impl)
    torch.manual_seed(0)
    model = model_class(config).float().train()
    if sum(p.numel() for p in model.parameters()) > MAX_PARAMETERS:
        raise ValueError(f"the shrunk config still has {sum(p.numel() for p in model.parameters()):,} parameters")
    return model


def tiny_config(config_class, model_type: str, base: dict | None = None):
    """``config_class`` with every field of ``SMALL`` it has, set before its ``__post_init__`` derives the
    rest. A sub-config (a composite's ``text_config``, its vision or audio tower, DBRX's ``attn_config``)
    is shrunk the same way, from the defaults its parent would give it, and passed in built."""
    import transformers

    base = dict(base or {})
    defaults = config_class(**base)
    small = {**SMALL, **LATENT} if _settable(defaults, "qk_rope_head_dim") else SMALL
    overrides = {key: value for key, value in small.items() if _settable(defaults, key)}
    overrides.update({key: value for key, value in SMALL_IF_ON.items() if _settable(defaults, key)
                      and _field(defaults, key)})
    overrides.update({token: 0 for token in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
                      if isinstance(_field(defaults, token), int) and _field(defaults, token) >= VOCAB})
    # No randomness: dropout, layer drop and router jitter would draw differently than eager does.
    overrides.update({key: 0.0 for key, value in defaults.to_dict().items()
                      if isinstance(value, float) and ("drop" in key or "jitter" in key)})
    # An alias (XLNet's num_attention_heads for n_head) is set after __post_init__ has derived sizes from
    # the field it names (d_head = d_model // n_head): set the field itself, where SMALL does not.
    aliases = getattr(config_class, "attribute_map", {})
    overrides = {aliases[key] if key in aliases and aliases[key] not in overrides else key: value
                 for key, value in overrides.items()}
    _keep_derived(defaults, overrides)
    fixes = PER_TYPE.get(model_type, {})
    specs = getattr(config_class, "sub_configs_defaults", None) or {}
    for key, value in vars(defaults).items():
        if isinstance(value, transformers.PretrainedConfig):
            sub_base = {**getattr(specs.get(key), "init_kwargs", {}), **fixes.get(key, {})}
            overrides[key] = tiny_config(type(value), value.model_type, sub_base)
    overrides.update({key: value for key, value in fixes.items() if key not in overrides
                      or not isinstance(overrides[key], transformers.PretrainedConfig)})
    return config_class(**{**base, **overrides})


def _keep_derived(defaults, overrides: dict) -> None:
    """Sizes one field derives from others, kept consistent after the shrink (see MAMBA_TILES)."""
    aliases = getattr(defaults, "attribute_map", {})

    def was(key):
        return _field(defaults, key)

    def now(key):
        return overrides.get(aliases.get(key, key), was(key))

    for heads, size, expand in MAMBA_TILES:
        if all(isinstance(was(key), int) for key in (heads, size, expand, "hidden_size")) and \
                was(heads) * was(size) == was(expand) * was("hidden_size"):
            overrides[aliases.get(heads, heads)] = now(expand) * now("hidden_size") // now(size)
    for groups, heads in MAMBA_GROUPS:
        if isinstance(now(groups), int) and isinstance(now(heads), int) and now(heads) % now(groups):
            overrides[aliases.get(groups, groups)] = 1
    # A model with language adapters (X-MOD) refuses a batch without a language: its first one.
    if was("default_language") is None and was("languages"):
        overrides["default_language"] = list(was("languages"))[0]


def _field(config, key: str):
    """``config.key``, or None where it has none. A heterogeneous config (Gemma 4's per-layer head_dim)
    refuses to read a per-layer field globally: it still has the field, and takes it in its constructor."""
    try:
        return getattr(config, key, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return type(config).__dataclass_fields__[key].default if key in getattr(config, "__dataclass_fields__", {}) \
            else True


def _settable(config, key: str) -> bool:
    """Whether the constructor takes ``key``: a field it has, not a property derived from other fields
    (Falcon's head_dim is hidden_size // num_attention_heads; xLSTM's v_head_dim likewise) or one whose
    setter refuses (ProphetNet's num_hidden_layers, XLNet's max_position_embeddings)."""
    import copy

    attribute = getattr(type(config), key, None)
    if isinstance(attribute, property):
        try:
            setattr(copy.deepcopy(config), key, _field(config, key))
        except Exception:
            return False
    try:
        return hasattr(config, key)
    except RuntimeError:  # a heterogeneous config's per-layer field, see _field
        return True


def attention_of(model_class, impl: str) -> str:
    """``auto``: sdpa where the model supports it, else its eager attention."""
    return ("sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager") if impl == "auto" else impl


def _relative_error(got, want) -> float:
    """Max abs error over the reference's magnitude, floored at 1e-4: a gradient that is zero up to
    rounding (a key bias, which the softmax cancels) is measured against 1e-8, as the suite's checks do."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    if not want.numel():
        return 0.0
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-4)


def sweep_row(model_type: str, impl: str) -> Row:
    """One architecture on this rank; the caller's process group is initialized."""
    import copy

    import torch

    from ulysses_compile.backend import ulysses
    from ulysses_compile.core.errors import UlyssesError

    row, started = Row(model_type, impl), time.monotonic()
    torch.compiler.reset()
    try:
        model = tiny_model(model_type, impl)
        row.impl = model.config._attn_implementation
        reference = copy.deepcopy(model)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "labels": ids, "use_cache": False}  # a training step keeps no cache
        want = reference(**inputs)
        want.loss.backward()
    except Exception as error:  # the harness's tiny config, not the compiler: its own row
        row.outcome, row.reason = "not built here", f"{type(error).__name__}: {error}"[:300]
        return _timed(row, started)
    reports = []

    def backend(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options={"compiler": "aot_eager"})
        reports.append(gm.meta["ulysses_report"])
        return compiled

    try:
        got = torch.compile(model, backend=backend)(**inputs)
        got.loss.backward()
    except Exception as error:
        refusal = error if isinstance(error, UlyssesError) else getattr(error, "inner_exception", None)
        if isinstance(refusal, UlyssesError):  # raised in the backend, Dynamo wraps it in BackendCompilerFailed
            row.outcome, row.reason = "refused with an error", f"{type(refusal).__name__}: {refusal}"[:300]
            return _timed(row, started)
        row.reason = f"{type(error).__name__}: {str(error).strip()[:300]} ... {traceback.format_exc()[-300:]}"
        if not _compiles_without_ulysses(reference, inputs):
            row.outcome = "torch.compile fails without ulysses"
        return _timed(row, started)
    pairs = [(got.loss, want.loss), (got.logits, want.logits)]
    named = dict(reference.named_parameters())
    pairs += [(p.grad, named[n].grad) for n, p in model.named_parameters()
              if p.grad is not None or named[n].grad is not None]
    # A parameter whose output nobody reads gets a zero gradient from torch.compile itself where eager
    # leaves None (BigBird's pooler): None is compared as zeros.
    row.worst_error = max(_relative_error(torch.zeros_like(w) if g is None else g,
                                          torch.zeros_like(g) if w is None else w) for g, w in pairs)
    _describe(row, reports)
    if not row.worst_error <= RTOL:
        row.outcome = "SILENT MISMATCH"
    return _timed(row, started)


def _compiles_without_ulysses(model, inputs) -> bool:
    import torch

    torch.compiler.reset()
    try:
        torch.compile(model, backend="aot_eager")(**inputs).loss.backward()
    except Exception:
        return False
    return True


def _describe(row: Row, reports) -> None:
    sites = [site for report in reports for site in report.attention_sites]
    row.sites = len(sites)
    row.parallel_sites = sum("parallelized" in site.decision for report in reports if not report.replicated
                             for site in report.attention_sites)
    row.all_to_alls = sum(c.kind in ("seq_to_heads_qkv", "seq_to_heads", "heads_to_seq") for r in reports
                          for c in r.collectives)
    row.gathers = sorted({f"{f.op}: {f.reason}"[:120] for r in reports for f in r.fallbacks})
    reasons = [r.replicated for r in reports if r.replicated] + [s.decision for s in sites
                                                                 if "parallelized" not in s.decision]
    reasons += [why for r in reports for why in r.rejected_attention]
    row.reason = "; ".join(dict.fromkeys(reasons))[:300]
    # a graph without attention split for its causal convolutions (Mamba's) is parallel too
    convolutions = sum(len(r.convolutions) for r in reports if not r.replicated)
    rejected = any(r.rejected_attention for r in reports)
    if (row.sites or convolutions) and row.parallel_sites == row.sites and not row.gathers and not rejected:
        row.outcome = "parallel, exact"
    elif row.parallel_sites or convolutions:
        row.outcome = "partly parallel, exact"
    elif row.reason:
        row.outcome = "replicated with a reason, exact"
    else:
        row.outcome = "SILENT MISMATCH"  # replicated with no reason the user sees: a defect of its own
        row.reason = "replicated, and the report says nothing of why"


def _timed(row: Row, started: float) -> Row:
    row.seconds = round(time.monotonic() - started, 1)
    return row


def _serve(rank: int, world_size: int, jobs: list, out: str) -> None:
    """Rows in order on this rank, each written to ``out`` by rank 0. A row that ends other than exact
    ends the process: the ranks may have stopped at different collectives, so none is trusted after."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for model_type, impl in jobs:
        row = sweep_row(model_type, impl)
        if rank == 0:
            Path(out, f"{model_type}.{impl}.json").write_text(json.dumps(asdict(row)))
        if "exact" not in row.outcome:
            os._exit(0)
    dist.destroy_process_group()


def sweep(jobs: list, world_size: int, report=print) -> list[Row]:
    """Every (model type, attention) job at ``world_size`` gloo ranks; a crash or a hang is its row."""
    import socket

    import torch.multiprocessing as mp

    rows: dict[tuple, Row] = {}
    with tempfile.TemporaryDirectory() as out:
        while len(rows) < len(jobs):
            pending = [job for job in jobs if job not in rows]
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
            ranks = mp.start_processes(_serve, args=(world_size, pending, out), nprocs=world_size, join=False,
                                       start_method="spawn")
            last, failure = time.monotonic(), ""
            while len(rows) < len(jobs):
                try:
                    done = ranks.join(timeout=1)
                except Exception as error:  # a rank died: it crashed, or a collective timed out
                    done, failure = True, f"a rank died: {str(error).strip().splitlines()[-1][:200]}"
                for job in pending:
                    path = Path(out, f"{job[0]}.{job[1]}.json")
                    if job not in rows and path.exists():
                        rows[job], last = Row(**json.loads(path.read_text())), time.monotonic()
                        report(rows[job])
                if not done and time.monotonic() - last > TIME_LIMIT_S:
                    failure = f"no result within {TIME_LIMIT_S} s (a hang)"
                if done or failure:
                    break
            for process in ranks.processes:
                process.kill()
            current = next((job for job in pending if job not in rows), None)
            if current is not None and failure:
                rows[current] = Row(*current, reason=failure)
                report(rows[current])
    return [rows[job] for job in jobs]


def table(rows: list[Row]) -> str:
    counts = {outcome: sum(row.outcome == outcome for row in rows) for outcome in OUTCOMES}
    lines = [" · ".join(f"{outcome}: {count}" for outcome, count in counts.items() if count), "",
             "| model type | attention | outcome | sites parallel | all-to-alls | gathered | reason |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        gathered = "; ".join(row.gathers)[:160]
        lines.append(f"| {row.model_type} | {row.impl} | {row.outcome} | {row.parallel_sites}/{row.sites} | "
                     f"{row.all_to_alls} | {gathered} | {_last_line(row) if row.outcome != OUTCOMES[0] else ''} |"
                     .replace("\n", " "))
    return "\n".join(lines) + "\n"


def _last_line(row: Row) -> str:
    return row.reason.strip().splitlines()[-1][:200] if row.reason.strip() else ""


def _print_row(row: Row) -> None:
    reason = _last_line(row)[:100]
    print(f"{row.model_type:28} {row.impl:6} {row.outcome:32} {row.parallel_sites}/{row.sites} {row.seconds:6.1f}s "
          f"{reason}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--impl", nargs="+", default=["sdpa", "eager"],
                        help="attention implementations; auto: sdpa where the model has it, else eager")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--start-at", help="skip the model types before this one (alphabetically)")
    parser.add_argument("--table", help="write the markdown table here")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    types = args.only.split(",") if args.only else list(causal_lm_types())
    if args.start_at:
        types = [model_type for model_type in types if model_type >= args.start_at]
    done: list[Row] = []

    def report(row: Row) -> None:
        _print_row(row)
        done.append(row)
        if args.json:  # after every row: a sweep stopped half-way keeps what it found
            Path(args.json).write_text(json.dumps([asdict(row) for row in done], indent=1))

    rows = sweep([(model_type, impl) for model_type in types for impl in args.impl], args.world_size, report)
    if args.table:
        Path(args.table).write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
