"""``explain`` (one process, simulated ranks), the command line (``explain`` and ``verify`` on model files
written here), and the graph dumps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import tiny_llama, token_batch
from sequence_models import break_in_every_block
from ulysses_compile import DivisibilityError, UlyssesError, cli, explain
from ulysses_compile.core.sharding import block_sizes


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_explain_reports_sites_and_collectives_equal_to_the_formula(world_size):
    heads, kv_heads, head_dim, layers, batch = 8, (4 if world_size < 8 else 8), 8, 2, 2
    seq = 60 if world_size == 8 else 64  # at 8 ranks blocks of 8 and 7: the last rank's are 7
    model = tiny_llama(heads=heads, kv_heads=kv_heads, layers=layers)
    ids, labels = token_batch(batch=batch, seq=seq)
    rank = world_size - 1
    report = explain(model, input_ids=ids, labels=labels, use_cache=False, world_size=world_size, rank=rank)

    assert not dist.is_initialized() and all(p.grad is None for p in model.parameters())  # nothing left behind
    assert [site.module for site in report.attention_sites] == [f"model.layers.{i}.self_attn" for i in range(layers)]
    local = block_sizes(seq, world_size)[rank]
    for site in report.attention_sites:
        assert (site.heads, site.kv_heads, site.head_dim, site.seq_len) == (heads, kv_heads, head_dim, seq)
        assert site.decision.startswith("parallelized: heads per rank")
        assert f"heads {heads} on {world_size} ranks: {heads // world_size} each" in site.divisibility
        assert ("uneven blocks" in site.divisibility) == (seq % world_size != 0)
    # Forward: q, k, v of this rank's block, all heads (one all-to-all for the three); the output of its
    # heads, whole sequence. The backward sends the mirror images. fp32.
    local_heads, local_kv = heads // world_size, kv_heads // world_size
    forward = batch * (local * (heads + 2 * kv_heads) + seq * local_heads) * head_dim * 4
    backward = batch * (seq * (local_heads + 2 * local_kv) + local * heads) * head_dim * 4
    totals = report.totals()
    assert totals[("forward", "all_to_all")] == (2 * layers, forward * layers)
    assert totals[("backward", "all_to_all")] == (2 * layers, backward * layers)
    assert report.ulysses_minimum_bytes == report.all_to_all_bytes() == layers * (forward + backward)
    assert ("forward", "all_gather") not in totals  # the logits leave as the rank's block, gathered when read
    assert totals[("forward", "all_reduce")][0] == 2  # the loss: its sum and its token count
    parameters = len(list(model.parameters()))
    syncs = [call for call in report.collectives if call.purpose == "sync_grad"]
    assert len(syncs) == totals[("backward", "all_reduce")][0] == parameters
    assert {call.where for call in report.collectives if call.kind == "all_to_all"} == {
        site.module for site in report.attention_sites}
    assert report.fallbacks == [] and report.graph_breaks == [] and report.memory.at().saved > 0
    (graph,) = report.graphs
    assert "seq_to_heads" not in graph.captured
    rewritten = graph.graphs["insert_all_to_all"]
    assert rewritten.count("seq_to_heads_qkv(") == layers and rewritten.count("seq_to_heads(") == 0
    assert rewritten.count("heads_to_seq(") == layers and "gather_kv_heads" not in rewritten
    text = str(report)
    assert f"ulysses_compile at P = {world_size} (rank {rank})" in text
    assert "Ulysses minimum" in text and "1.00x" in text


class FlippingBlock(torch.nn.Module):
    """Plain PyTorch with a graph break (a print-like call Dynamo cannot trace) and a cross-sequence op
    with no sharded rule (``torch.flip`` over tokens), to see both reported."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(64, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, 64)

    def forward(self, idx):
        x = self.embed(idx)
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        y = torch.flip(y, dims=(1,))
        torch._dynamo.graph_break()
        return self.out(y)


def test_explain_reports_fallbacks_with_their_source_and_graph_breaks():
    idx = torch.randint(0, 64, (2, 16))
    report = explain(FlippingBlock(), idx, world_size=4)
    assert len(report.graphs) == 2 and len(report.graph_breaks) == 1
    assert len(report.attention_sites) == 1
    (fallback,) = report.fallbacks
    assert "flip" in fallback.op and "torch.flip(y, dims=(1,))" in fallback.source
    assert "fallbacks: 1" in str(report) and "graph break" in str(report)


def test_explain_counts_every_run_of_a_graph_dynamo_reuses_for_each_layer():
    """A graph break inside every block: one compiled graph holds a block's attention and runs once per
    layer; the report counts each run's site, all-to-alls and saved activations."""
    layers = 3
    model, args, kwargs = break_in_every_block(layers=layers)
    report = explain(model, *args, world_size=2, **kwargs)
    with_sites = [index for index in set(report.runs) if report.graphs[index].attention_sites]
    runs = {index: report.runs.count(index) for index in with_sites}
    assert len(report.graphs) < len(report.runs) and max(runs.values()) > 1, report.runs
    assert len(report.attention_sites) == sum(runs.values()) == layers and report.fallbacks == [], str(report)
    totals = report.totals()
    assert totals[("forward", "all_to_all")][0] == totals[("backward", "all_to_all")][0] == 2 * layers
    assert all(f"graph {index} runs {count} times" in str(report) for index, count in runs.items() if count > 1)
    one_layer = explain(*break_in_every_block(layers=1)[:1], *args, world_size=2, **kwargs)
    assert report.memory.at().saved > 2 * one_layer.memory.at().saved


def test_explain_errors(fake_group):
    ids, labels = token_batch()
    with pytest.raises(DivisibilityError, match="4 query heads cannot be split over 8 sequence-parallel ranks"):
        explain(tiny_llama(heads=4, kv_heads=4), input_ids=ids, world_size=8, options={"ring": 1})
    with pytest.raises(UlyssesError, match="world_size=1"):
        explain(tiny_llama(), input_ids=ids, world_size=1)
    fake_group(2)
    with pytest.raises(UlyssesError, match="already initialized in this process; call explain before"):
        explain(tiny_llama(), input_ids=ids, world_size=4)


def test_dump_dir_holds_each_pass_and_the_report(fake_group, tmp_path):
    fake_group(2)
    ids, labels = token_batch()
    compiled = torch.compile(tiny_llama(layers=1), backend="ulysses",
                             options={"compiler": "eager", "dump_dir": str(tmp_path)})
    compiled(input_ids=ids, labels=labels, use_cache=False)
    (folder,) = (tmp_path / "rank0").iterdir()
    names = sorted(path.name for path in folder.iterdir())
    assert names[0] == "00_captured.py" and "report.txt" in names and len(names) == 22 + 2  # the captured graph, 22 passes
    (after,) = folder.glob("*_insert_all_to_all.py")
    assert "seq_to_heads_qkv(" in after.read_text() and "seq_to_heads" not in (folder / "00_captured.py").read_text()
    assert "attention sites: 1" in (folder / "report.txt").read_text()


MODEL_FILE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make():
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4)
    ids = torch.randint(0, 128, (2, 32))
    return LlamaForCausalLM(config), (), {"input_ids": ids, "labels": ids, "use_cache": False}
"""


# The model file with the fault of tests/faults.py, applied in every rank that imports it.
BROKEN = """
from faults import drop_output_all_to_all

drop_output_all_to_all()
"""


def _cli(*arguments, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ulysses_compile", *arguments], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_cli_explain_on_a_model_file(tmp_path, capsys):
    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL_FILE))
    trace = tmp_path / "trace"
    result = _cli("explain", f"{tmp_path}/model.py:make", "--world-size", "4", env={"TORCH_TRACE": str(trace)})
    assert result.returncode == 0, result.stderr
    assert "attention sites: 2" in result.stdout and "1.00x" in result.stdout
    assert "model.layers.1.self_attn" in result.stdout
    logged = "".join(path.read_text() for path in trace.iterdir())  # tlparse's input
    assert "ulysses_compile_insert_all_to_all" in logged and "ulysses_compile_report" in logged

    with pytest.raises(SystemExit) as usage:
        cli.main(["--help"])
    assert usage.value.code == 0 and "verify" in capsys.readouterr().out
    assert cli.main(["explain", f"{tmp_path}/model.py:build", "--world-size", "4"]) == 2
    assert "defines no function 'build'" in capsys.readouterr().err


def test_cli_explain_on_the_moe_example(capsys):
    """A factory file with a dataclass config (``examples/moe_gpt.py``): its MoE blocks gather nothing."""
    example = Path(__file__).resolve().parents[1] / "examples" / "moe_gpt.py"
    assert cli.main(["explain", f"{example}:make", "--world-size", "2"]) == 0
    printed = capsys.readouterr().out
    assert "attention sites: 2" in printed and "fallbacks: 0" in printed, printed


@pytest.mark.multirank
@pytest.mark.slow  # verify=True on two ranks stays in the default tier (test_multirank); this is its CLI
def test_cli_verify_passes_a_correct_program(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL_FILE))
    good = _cli("verify", f"{tmp_path}/model.py:make", "--world-size", "2")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "every output and gradient matches eager" in good.stdout and "grad lm_head.weight" in good.stdout


@pytest.mark.multirank
@pytest.mark.slow
def test_cli_verify_catches_a_dropped_all_to_all(tmp_path):
    """The same fault as test_multirank's verify test, through the command line (slow: two more spawns)."""
    (tmp_path / "broken.py").write_text(textwrap.dedent(MODEL_FILE) + BROKEN)
    broken = _cli("verify", f"{tmp_path}/broken.py:make", "--world-size", "2",
                  env={"PYTHONPATH": str(Path(__file__).parent)})
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "output logits" in broken.stdout and "MISMATCH on ranks [0, 1]" in broken.stdout


def test_cross_attention_minimum_counts_each_sequence(fake_group):
    """Queries from 6 learned latents, keys and values from 30 tokens: one all-to-all sends the three, each
    of its own length, and the minimum counts each length (it once took the query's for all three,
    reporting 3.00x)."""
    from attention_forms import LatentQueries

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 30))
    report = explain(LatentQueries(), ids, torch.tensor([0, 2]), world_size=2)
    sent = sorted((call.phase, call.purpose) for call in report.collectives if call.kind == "all_to_all")
    assert sent == [("backward", "heads_to_seq"), ("backward", "seq_to_heads_qkv"),
                    ("forward", "heads_to_seq"), ("forward", "seq_to_heads_qkv")], sent
    assert report.all_to_all_bytes() == report.ulysses_minimum_bytes == 2 * 2 * (3 * 4 + 2 * 15 * 4 + 6 * 2) * 8 * 4


def test_zero_with_sequence_parallelism_reduces_each_gradient_once():
    """Each parameter's gradient leaves the backward by one reduce-scatter over the ranks holding its
    shards; the sequence ranks' all-reduce of their shares (sync_grad) is merged into it."""
    ids, labels = token_batch()
    model = tiny_llama()
    report = explain(model, input_ids=ids, labels=labels, world_size=2, zero_stage=2)
    backward = [call for call in report.collectives if call.phase == "backward"]
    assert [call for call in backward if call.kind not in ("reduce_scatter", "all_to_all")] == []
    assert sum(call.kind == "reduce_scatter" for call in backward) == len(list(model.parameters()))
    (graph,) = report.graphs
    assert "sync_grad" not in graph.graphs["merge_gradient_reductions"]
    assert "sync_grad" in graph.graphs["average_data_parallel_grads"]


PROFILED_KINDS = {"all_to_all": "alltoall", "all_gather": "allgather", "all_reduce": "allreduce",
                  "reduce_scatter": "reduce_scatter_tensor"}


def _explained_calls(zero_stage: int, layers: int, compiler: str) -> dict[str, int]:
    ids, labels = token_batch(seq=32)
    report = explain(tiny_llama(layers=layers), input_ids=ids, labels=labels, use_cache=False, world_size=2,
                     zero_stage=zero_stage, options={"check_inputs": False})
    totals = {key: count for key, (count, _) in report.totals().items()}
    calls = {}
    for (_, kind), count in (report.calls_under_inductor if compiler == "inductor" else totals).items():
        calls[PROFILED_KINDS[kind]] = calls.get(PROFILED_KINDS[kind], 0) + count
    return calls


def profiled_calls_match_explain(rank, world_size, zero_stage, layers, compiler, explained):
    from zero_memory import collectives_by_kind

    from ulysses_compile import parallelize

    ids, labels = token_batch(seq=32)
    options = {"compiler": compiler, "check_inputs": False}
    model = tiny_llama(layers=layers)
    compiled = parallelize(model, zero_stage=zero_stage, **options) if zero_stage else \
        torch.compile(model, backend="ulysses", options=options)

    def step():
        compiled(input_ids=ids, labels=labels, use_cache=False).loss.backward()

    step()  # the first call compares what the ranks compiled and hold: checks outside the programs
    called = Counter()
    for kind, count in collectives_by_kind(step).items():  # a bucket of several: "_allgather"
        called[kind.lstrip("_")] += count
    assert dict(called) == explained, (dict(called), explained)


@pytest.mark.multirank
@pytest.mark.parametrize("zero_stage, compiler", [(0, "aot_eager"), pytest.param(3, "aot_eager", marks=pytest.mark.slow),
                                                  pytest.param(0, "inductor", marks=pytest.mark.slow),
                                                  pytest.param(3, "inductor", marks=pytest.mark.slow)])
def test_explain_lists_the_collectives_a_compiled_step_calls(zero_stage, compiler):
    """What explain lists for the forward and backward programs is what torch's profiler counts the
    compiled step calling on two gloo ranks, kind by kind: AOTAutograd's programs run as they are
    (aot_eager), or once Inductor buckets ZeRO's all-gathers and reduce-scatters of each layer."""
    from multirank import run_ranks

    explained = _explained_calls(zero_stage, layers=2, compiler=compiler)
    run_ranks(profiled_calls_match_explain, 2, zero_stage, 2, compiler, explained)


def test_explain_shows_the_ring_plan_and_its_bytes_against_their_minimum(monkeypatch):
    """2 heads at P = 4: Ulysses over pairs x a ring of 2; its sends are the minimum, the all-to-alls too.
    Two "nodes" of 2 ranks (torchrun's LOCAL_WORLD_SIZE) with 4 heads: the same plan, for the nodes; with
    one key/value head no pair splits them, so Ulysses spans the nodes, with the reason."""
    ids, labels = token_batch(seq=32)
    kwargs = {"input_ids": ids, "labels": labels, "use_cache": False}
    report = explain(tiny_llama(heads=2, kv_heads=2, layers=2), world_size=4, **kwargs)
    assert [(site.decision.split(",")[0]) for site in report.attention_sites] == [
        "parallelized: Ulysses over 2 ranks (heads per rank 1"] * 2
    rings = [call for call in report.collectives if call.kind == "ring"]
    assert [call.phase for call in rings] == ["forward"] * 2 + ["backward"] * 2, rings
    assert sum(call.bytes for call in rings) == report.ring_minimum_bytes > 0
    assert report.all_to_all_bytes() == report.ulysses_minimum_bytes > 0
    assert "ring 12,288 B sent against the minimum 12,288 B" in str(report)  # 2 x [2, 1, 16, 8] fp32 k, v: 2 layers x 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    report = explain(tiny_llama(heads=4, kv_heads=4, layers=1), world_size=4, **kwargs)
    assert "x ring over 2 ranks, the largest group that splits 4 query / 4 key/value heads and fits 2 ranks per " \
           "node" in report.attention_sites[0].decision
    report = explain(tiny_llama(heads=4, kv_heads=1, layers=1), world_size=4, **kwargs)
    assert "across nodes without a ring: no group on one node splits the query and key/value heads" in \
           report.attention_sites[0].decision


def test_explain_generation_shows_the_prompt_and_decoding_plans_and_the_cache_per_rank(tmp_path, capsys):
    """The prompt's call with a KV cache and two decoding steps, at P = 2 in this process (and at P = 4
    from the CLI): the prompt parallel, each step's attention on the rank's heads of the cache, the cache
    per rank 1/P of one device's."""
    from ulysses_compile import explain_generation

    ids, _ = token_batch(seq=32)
    report = explain_generation(tiny_llama(heads=4, kv_heads=2, layers=2), ids, world_size=2, new_tokens=2)
    assert len(report.prompt) == 1 and not report.prompt[0].replicated, str(report)
    assert report.decoding and all(site.on_cache_heads for graph in report.decoding for site in graph.attention_sites)
    assert report.cache_bytes * 2 == report.whole_cache_bytes and report.cache_layout == "the rank's heads"
    text = str(report)
    assert "decoding: collectives per call: reduce_partial x2" in text and "0.500 of one device's" in text, text
    assert "decoding: projections on the rank's heads: 6 linear layer(s) read the rank's heads' rows of their " \
           "weights (q, k, v), 2 its columns" in text, text
    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL_FILE))
    assert cli.main(["explain", f"{tmp_path}/model.py:make", "--world-size", "4", "--generate", "2"]) == 0
    printed = capsys.readouterr().out
    assert "on the rank's heads of its key/value cache" in printed and "0.250 of one device's" in printed, printed
