"""Every causal LM in the installed transformers, from a tiny config made here, at P gloo ranks against
eager: is each attention parallelized, and is the answer exact?

    .venv/bin/python tests/zoo_sweep.py                      # the full sweep, sdpa and eager, P = 2
    .venv/bin/python tests/zoo_sweep.py --only llama,gpt2 --impl sdpa --table docs/zoo.md

Each architecture runs in its own P processes with a time limit, so a crash or a hang is one row of the
table, not the end of the sweep. A config is shrunk by setting the fields it has (hidden size, layers,
heads, experts, low-rank dims, vocabulary) before its ``__post_init__`` derives the rest (layer types).
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
}
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
    import torch
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type)
    small = {**SMALL, **LATENT} if hasattr(defaults, "qk_rope_head_dim") else SMALL
    overrides = {key: value for key, value in small.items() if hasattr(defaults, key)}
    overrides.update({token: 0 for token in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
                      if isinstance(getattr(defaults, token, None), int) and getattr(defaults, token) >= VOCAB})
    # No randomness: dropout, layer drop and router jitter would draw differently than eager does.
    overrides.update({key: 0.0 for key, value in defaults.to_dict().items()
                      if isinstance(value, float) and ("drop" in key or "jitter" in key)})
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    model_class = getattr(transformers, causal_lm_types()[model_type])
    config._attn_implementation = attention_of(model_class, impl)
    nested = [key for key, value in vars(config).items() if isinstance(value, transformers.PretrainedConfig)]
    if nested:
        raise ValueError(f"sub-configs ({', '.join(nested)}) are not shrunk here")
    torch.manual_seed(0)
    model = model_class(config).float().train()
    if sum(p.numel() for p in model.parameters()) > MAX_PARAMETERS:
        raise ValueError(f"the shrunk config still has {sum(p.numel() for p in model.parameters()):,} parameters")
    return model


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
    except UlyssesError as error:
        row.outcome, row.reason = "refused with an error", f"{type(error).__name__}: {error}"[:300]
        return _timed(row, started)
    except Exception as error:
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
    if row.sites and row.parallel_sites == row.sites and not row.gathers:
        row.outcome = "parallel, exact"
    elif row.parallel_sites:
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
