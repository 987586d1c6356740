"""Real gloo ranks against single-device eager: loss, outputs and every parameter gradient."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import nanogpt
from graphs import reporting_backend
from op_probes import PROBES
from models import (
    MeanPooledClassifier,
    model_zoo,
    tiny_deepseek_v3,
    tiny_gpt2,
    tiny_llama,
    tiny_t5,
    token_batch,
    zoo_inputs,
)
from multirank import assert_close, compare_model, run_ranks, step_against_eager
from ulysses_compile.core.compat import run_and_get_code

pytestmark = pytest.mark.multirank


def _hf_case(kind: str, world_size: int):
    if kind == "llama":
        model = tiny_llama(heads=8, kv_heads=4)
    else:
        model = tiny_gpt2(heads=4)
    ids, labels = token_batch(seq=64)
    return model, (), {"input_ids": ids, "labels": labels, "use_cache": False}


def _outputs(kind, result):
    if kind in ("nanogpt", "mean_pooled"):
        logits, loss = result
        return {"loss": loss, "logits": logits}
    return {"loss": result.loss, "logits": result.logits}


def equal_to_eager(rank, world_size, kind, compiler, options):
    if kind == "nanogpt":
        model, args, kwargs = nanogpt.make(seq_len=64)
    elif kind == "mean_pooled":
        torch.manual_seed(0)
        model, kwargs = MeanPooledClassifier(), {}
        args = (torch.randint(0, 128, (2, 64)), torch.tensor([1, 2]))
    else:
        model, args, kwargs = _hf_case(kind, world_size)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": compiler, **options})

    def step():
        result = _outputs(kind, compiled(*args, **kwargs))
        result["loss"].backward()
        return result

    got, codes = run_and_get_code(step)
    if compiler == "inductor" and kind == "llama":
        _check_inductor_collectives(codes, layers=2)
    want = _outputs(kind, reference(*args, **kwargs))
    want["loss"].backward()
    compare_model(rank, model, reference, {k: (got[k], want[k]) for k in got})


def _check_inductor_collectives(codes: list[str], layers: int) -> None:
    """Inductor's forward and backward modules: 2 all-to-alls per layer each way (q, k and v to heads in
    one, the output back in the other), the loss's two scalar sums, and every parameter gradient in one
    bucketed all-reduce; the logits leave ungathered."""
    forward, backward = codes

    def calls(code, op):
        return len(re.findall(rf"_c10d_functional\.{op}\.default\(", code))

    assert [calls(forward, op) for op in ("all_to_all_single", "all_gather_into_tensor", "all_reduce_")] == [
        2 * layers, 0, 2]
    assert [calls(backward, op) for op in ("all_to_all_single", "all_reduce_")] == [2 * layers, 1]


# Inductor at 4 ranks, and for GPT-2 at 2, in the slow tier: each is about a minute of compiling.
CASES = [
    ("llama", 2, "inductor", False),
    ("llama", 4, "inductor", True),
    ("gpt2", 2, "inductor", True),
    ("gpt2", 4, "aot_eager", False),
    ("nanogpt", 2, "inductor", False),
    ("nanogpt", 4, "aot_eager", False),
    ("mean_pooled", 2, "aot_eager", False),
]


@pytest.mark.parametrize("kind,world_size,compiler", [
    pytest.param(k, p, c, id=f"{k}-P{p}-{c}", marks=[pytest.mark.slow] if slow else []) for k, p, c, slow in CASES])
def test_equal_to_eager(kind, world_size, compiler):
    run_ranks(equal_to_eager, world_size, kind, compiler, {})


def qkv_equal_to_eager(rank, world_size, kv_heads, layers):
    """A Llama with 8 query heads, compiled on real ranks: the collectives the report lists, then loss,
    logits and every parameter gradient against eager."""
    model = tiny_llama(heads=8, kv_heads=kv_heads, layers=layers)
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=64)
    kwargs = {"input_ids": ids, "labels": labels, "use_cache": False}
    reports = []
    got = torch.compile(model, backend=reporting_backend(reports))(**kwargs)
    got.loss.backward()
    (report,) = reports
    assert len(report.attention_sites) == layers and report.fallbacks == [] and not report.replicated, str(report)
    kinds = [c.kind for c in report.collectives]
    counted = [kinds.count(kind) for kind in ("seq_to_heads_qkv", "seq_to_heads", "gather_kv_heads", "heads_to_seq")]
    if kv_heads % world_size == 0:  # one all-to-all for q, k and v
        assert counted == [layers, 0, 0, layers], kinds
    else:  # q alone by all-to-all, each rank gathering the KV heads its query heads use
        assert counted == [0, layers, 2 * layers, layers], kinds
    want = reference(**kwargs)
    want.loss.backward()
    assert all(param.grad is not None for param in model.parameters())
    errors = compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})
    assert len([name for name in errors if name.startswith("grad ")]) == len(list(model.parameters()))


@pytest.mark.parametrize("world_size,kv_heads", [(2, 4), (4, 2)], ids=["P2-kv4-one-all-to-all", "P4-kv2-kv-gathered"])
def test_qkv_by_one_all_to_all_or_kv_gathered_equal_to_eager(world_size, kv_heads):
    """KV heads that split like the query heads (4 of 8 at P = 2) travel with q in one all-to-all, and
    its backward is one all-to-all as well; 2 KV heads at P = 4 do not split like them, so q goes alone
    and k and v are gathered (their backward a reduce-scatter). The AOT graphs' collectives (explain, one
    process), then equality with eager on real ranks."""
    from ulysses_compile import explain

    layers = 2
    ids, labels = token_batch(seq=64)
    report = explain(tiny_llama(heads=8, kv_heads=kv_heads, layers=layers), input_ids=ids, labels=labels,
                     use_cache=False, world_size=world_size)
    counted = {}
    for call in report.collectives:
        if call.purpose != "sync_grad" and call.purpose != "reduce_partial":
            key = (call.phase, call.kind, call.purpose)
            counted[key] = counted.get(key, 0) + 1
    if kv_heads % world_size == 0:
        assert counted == {("forward", "all_to_all", "seq_to_heads_qkv"): layers,
                           ("forward", "all_to_all", "heads_to_seq"): layers,
                           ("backward", "all_to_all", "seq_to_heads_qkv"): layers,
                           ("backward", "all_to_all", "heads_to_seq"): layers}, counted
    else:
        assert counted == {("forward", "all_to_all", "seq_to_heads"): layers,
                           ("forward", "all_gather", "gather_kv_heads"): 2 * layers,
                           ("forward", "all_to_all", "heads_to_seq"): layers,
                           ("backward", "all_to_all", "seq_to_heads"): layers,
                           ("backward", "reduce_scatter", "gather_kv_heads"): 2 * layers,
                           ("backward", "all_to_all", "heads_to_seq"): layers}, counted
    run_ranks(qkv_equal_to_eager, world_size, kv_heads, layers)


def local_outputs(rank, world_size):
    model, args, kwargs = _hf_case("llama", world_size)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager", "outputs": "local"})
    got = compiled(*args, **kwargs)
    want = reference(*args, **kwargs)
    block = want.logits.shape[1] // world_size
    assert got.logits.shape[1] == block
    assert_close("local logits", got.logits, want.logits[:, rank * block : (rank + 1) * block])
    assert_close("loss", got.loss, want.loss)


def test_outputs_local_keeps_this_ranks_block():
    run_ranks(local_outputs, 2)


def verify_checks_against_eager(rank, world_size, outputs):
    """``verify=True`` accepts a correct program, with outputs gathered or kept local (each rank's block
    of uneven blocks, S = 31, compared with that block of eager's), and rejects one whose output
    all-to-all was dropped (the test-only fault switch, S = 32)."""
    from faults import output_all_to_all_dropped
    from ulysses_compile import VerificationError

    model, args, kwargs = nanogpt.make(seq_len=31)
    reference = copy.deepcopy(model)
    options = {"compiler": "aot_eager", "verify": True, "outputs": outputs}
    logits, loss = torch.compile(model, backend="ulysses", options=options)(*args, **kwargs)
    assert_close("loss", loss, reference(*args, **kwargs)[1])
    torch.compiler.reset()
    model, args, kwargs = nanogpt.make(seq_len=32)  # the fault's stand-in assumes even blocks
    with output_all_to_all_dropped(), pytest.raises(VerificationError, match="MISMATCH"):
        torch.compile(model, backend="ulysses", options=options)(*args, **kwargs)


@pytest.mark.parametrize("outputs", ["gather", "local"])
def test_verify_option_accepts_a_correct_program_and_rejects_a_broken_one(outputs):
    run_ranks(verify_checks_against_eager, 2, outputs)


def short_verify_checks_against_eager(rank, world_size):
    """``verify="short"`` runs the compiled program and eager once on a short sequence before the first
    call (S = 37 -> 5 at P = 2, 7 at P = 4: the same remainder, at least 2P): a correct program passes,
    with every output and parameter gradient compared and the call itself equal to eager; the fault
    (a shift after each output all-to-all) is caught at the short length."""
    from faults import output_all_to_all_dropped
    from graphs import calls
    from ulysses_compile.core.collectives import heads_to_seq, seq_to_heads, seq_to_heads_qkv
    from ulysses_compile.backend import ulysses
    from ulysses_compile import VerificationError

    options = {"compiler": "aot_eager", "verify": "short"}
    ids, labels = token_batch(seq=37)
    kwargs = {"input_ids": ids, "labels": labels, "use_cache": False}
    short = 2 * world_size + 37 % world_size

    def compiled_keeping_graphs(model, mesh=None, **compile_kwargs):
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return ulysses(gm, example_inputs, options={**options, "mesh": mesh})

        return torch.compile(model, backend=capture, **compile_kwargs), graphs

    model = tiny_llama(layers=1)
    reference = copy.deepcopy(model)
    compiled, graphs = compiled_keeping_graphs(model, dynamic=True)
    got, want = compiled(**kwargs), reference(**kwargs)
    got.loss.backward()
    want.loss.backward()
    compare_model(rank, model, reference, {"loss": (got.loss, want.loss), "logits": (got.logits, want.logits)})
    gm = graphs[-1]  # with dynamic=True Dynamo traces the frame twice (a float it makes symbolic, then not)
    report = gm.meta["ulysses_report"]
    assert len(report.attention_sites) == 1 and len(calls(gm, seq_to_heads_qkv)) == 1 and calls(gm, seq_to_heads) == []
    assert len(calls(gm, heads_to_seq)) == 1
    parameters = len(list(model.parameters()))
    assert [note for note in report.notes if note.startswith("verify")] == [
        f"verify='short': at sequence length {short} (this call 37) the compiled program's 2 outputs and "
        f"{parameters} gradients match eager"], report.notes
    assert any("runtime.token_loss_sum" in note for note in report.notes), report.notes  # the loss tiled

    torch.compiler.reset()  # plain PyTorch, whose dropout of 0 dynamic=True hands the graph as a tensor
    model, args, targets = nanogpt.make(seq_len=37, n_layer=1)
    compiled, graphs = compiled_keeping_graphs(model, dynamic=True)
    compiled(*args, **targets)[1].backward()
    (note,) = [note for note in graphs[-1].meta["ulysses_report"].notes if note.startswith("verify")]
    assert note.startswith(f"verify='short': at sequence length {short} (this call 37) "), note

    if world_size == 4:  # two data-parallel replicas of two sequence ranks, each replica its own batch
        from torch.distributed.device_mesh import init_device_mesh

        torch.compiler.reset()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        model, args, targets = nanogpt.make(seq_len=37, n_layer=1)
        replica_args, replica_targets = nanogpt.make(seq_len=37, n_layer=1, seed=rank // 2)[1:]
        compiled, graphs = compiled_keeping_graphs(model, dynamic=True, mesh=mesh)
        compiled(*replica_args, **replica_targets)[1].backward()
        (note,) = [note for note in graphs[-1].meta["ulysses_report"].notes if note.startswith("verify")]
        assert note.startswith("verify='short': at sequence length 5 (this call 37) "), note

    torch.compiler.reset()
    with output_all_to_all_dropped(), pytest.raises(VerificationError, match=f"short sequence length {short} "):
        torch.compile(tiny_llama(layers=1), backend="ulysses", dynamic=True, options=options)(**kwargs)


# slow: about a minute on two ranks; test_options.py checks verify="short" in one process
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_verify_short_checks_a_short_sequence(world_size):
    run_ranks(short_verify_checks_against_eager, world_size)


def zoo_equal_to_eager(rank, world_size, names):
    zoo = model_zoo()
    for name in names:
        factory, kind = zoo[name]
        model = factory()
        reference = copy.deepcopy(model)
        inputs = zoo_inputs(kind)
        torch.compiler.reset()
        got = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})(**inputs)
        got.loss.backward()
        want = reference(**inputs)
        want.loss.backward()
        compare_model(rank, model, reference, {f"{name} loss": (got.loss, want.loss),
                                               f"{name} logits": (got.logits, want.logits)})


def parallel_and_equal_to_eager(rank, world_size, name):
    model = {"t5": tiny_t5, "deepseek_v3": tiny_deepseek_v3, "gpt_oss_sinks": model_zoo()["gpt_oss_sinks"][0]}[name]()
    reference = copy.deepcopy(model)
    ids, labels = token_batch(seq=24)
    inputs = {"input_ids": ids, "labels": token_batch(seq=16, seed=2)[1] if name == "t5" else labels}
    reports = []
    backend = reporting_backend(reports)

    torch.compiler.reset()
    got = torch.compile(model, backend=backend)(**inputs)
    (report,) = reports
    sites = 6 if name == "t5" else 2  # T5: encoder self, decoder self and cross attention in two layers each
    assert len(report.attention_sites) == sites and not report.replicated, str(report)
    assert all("parallelized" in site.decision for site in report.attention_sites), str(report)
    # q, k and v turned to heads: in one all-to-all, or, with fewer KV heads than ranks (gpt-oss's 2 at
    # P = 4), q by its own and k and v gathered
    gathered = name == "gpt_oss_sinks" and world_size == 4
    kinds = [c.kind for c in report.collectives]
    assert [kinds.count(kind) for kind in ("seq_to_heads_qkv", "seq_to_heads", "gather_kv_heads", "heads_to_seq")] == (
        [0, sites, 2 * sites, sites] if gathered else [sites, 0, 0, sites]), str(report)
    # Nothing is gathered, on the way to attention or in the MoE blocks, but gpt-oss's sliding-window
    # cache (kept by the default use_cache=True) slicing the last keys.
    assert all("sliding_window" in f.source for f in report.fallbacks), str(report)
    got.loss.backward()
    want = reference(**inputs)
    want.loss.backward()
    compare_model(rank, model, reference, {f"{name} loss": (got.loss, want.loss),
                                           f"{name} logits": (got.logits, want.logits)})


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["t5", "deepseek_v3"])
def test_models_that_write_inputs_in_place_equal_to_eager(name, world_size):
    """T5's decoder inputs (labels shifted right into new_zeros) and DeepSeek-V3's keys (written into
    new_empty) were silently wrong: each conversion read the tensor before the writes. Every attention
    is parallelized, and DeepSeek-V3's keys are made in blocks, not gathered."""
    run_ranks(parallel_and_equal_to_eager, world_size, name)


def zoo_rows_parallel_and_equal_to_eager(rank, world_size, name, impl):
    from zoo_sweep import tiny_model

    ids, labels = token_batch(seq=24)
    torch.compiler.reset()
    reports = step_against_eager(rank, tiny_model(name, impl), input_ids=ids, labels=labels, use_cache=False)
    sites = [site for report in reports for site in report.attention_sites]
    assert len(sites) == 2 and all("parallelized" in site.decision for site in sites), reports
    kinds = [c.kind for report in reports for c in report.collectives]
    assert kinds.count("seq_to_heads_qkv") + kinds.count("seq_to_heads") >= 2 and kinds.count("heads_to_seq") == 2
    fallbacks = [f for report in reports for f in report.fallbacks]
    notes = [note for report in reports for note in report.notes if "whole: it is gathered" in note]
    if name == "deepseek_v32":
        # the indexer: its keys read whole by the rank's queries (not the queries gathered), and its top-k
        # positions gathered to build the attention's whole mask: two gathers, each of one value
        assert len(notes) == 1 and "(matmul) keeps its rows and reads" in notes[0] and "[2, 1, 16, 24]" in notes[0]
        assert [f.op for f in fallbacks] == ["scatter"], fallbacks
        assert kinds.count("gather_seq") == 2, kinds
    else:  # Gemma 3n's torch.multiply, GPT-1's key permuted from [B, S, H, D] in one step
        assert fallbacks == [] and notes == [] and "gather_seq" not in kinds, reports


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name, impl", [("deepseek_v32", "sdpa"), ("gemma3n_text", "sdpa"), ("openai-gpt", "eager")])
def test_zoo_rows_once_gathering_are_parallel_and_equal_to_eager(name, impl, world_size):
    """Rows of docs/zoo.md that gathered the sequence or ran replicated before: DeepSeek-V3.2's sparse
    attention indexer, Gemma 3n's per-layer inputs (``torch.multiply``), OpenAI-GPT's attention."""
    run_ranks(zoo_rows_parallel_and_equal_to_eager, world_size, name, impl)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_attention_with_sinks_equal_to_eager(world_size):
    """gpt-oss joins a learned logit per head to the scores and drops its column after the softmax: the
    sinks are sliced to the rank's heads with the scores, and every attention is parallelized."""
    run_ranks(parallel_and_equal_to_eager, world_size, "gpt_oss_sinks")


@pytest.mark.slow
def test_model_zoo_equal_to_eager_at_two_ranks():
    run_ranks(zoo_equal_to_eager, 2, sorted(model_zoo()))


@pytest.mark.slow
def test_shared_kv_heads_and_padding_masks_at_four_ranks():
    """Slow tier: MQA, GQA and padding masks at four ranks are also in test_attention_forms and
    test_sequences."""
    run_ranks(zoo_equal_to_eager, 4, ["bert_padding", "falcon_mqa", "llama_eager_attention", "qwen2"])


def probes_equal_to_eager(rank, world_size, lengths, names=None):
    probes = [(name, make) for name, make in PROBES.items() if names is None or name in names]
    for seq, (name, make) in ((seq, probe) for seq in lengths for probe in probes):
        torch.manual_seed(0)
        model = make()
        reference = copy.deepcopy(model)
        ids = torch.randint(0, 32, (2, seq), generator=torch.Generator().manual_seed(1))
        weights = torch.randn(2, seq, 32, generator=torch.Generator().manual_seed(2))
        torch.compiler.reset()
        got = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager"})(ids)
        (got * weights).sum().backward()
        want = reference(ids)
        (want * weights).sum().backward()
        compare_model(rank, model, reference, {f"{name} S={seq} output": (got, want)})


@pytest.mark.slow  # half a minute; lengths P does not divide run in test_sequences.py and test_properties.py
def test_op_probes_equal_to_eager_at_an_uneven_length():
    run_ranks(probes_equal_to_eager, 2, (15,))


@pytest.mark.slow
def test_op_probes_equal_to_eager_at_an_even_length():
    run_ranks(probes_equal_to_eager, 2, (16,))


class DropoutAfterAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from op_probes import Attention

        self.attn = Attention()

    def forward(self, x):
        return torch.nn.functional.dropout(x + 0 * self.attn(x), p=0.25, training=True)


def dropout_blocks(rank, world_size):
    torch.manual_seed(0)
    x = torch.ones(1, 64, 16, requires_grad=True)
    out = torch.compile(DropoutAfterAttention(), backend="ulysses", options={"compiler": "aot_eager"})(x)
    out.sum().backward()
    kept = out.detach() != 0
    # ones times the kept mask's scale (1 + 0 * attention is exactly 1): exact by construction
    assert torch.equal(out.detach()[kept], torch.full_like(out.detach()[kept], 1 / 0.75))
    assert torch.equal(x.grad, out.detach())  # forward and backward use the same mask
    blocks = out.detach().view(world_size, -1)
    assert not torch.equal(blocks[0], blocks[1]), "ranks drew the same mask for their blocks"
    assert 0.6 < (out != 0).float().mean().item() < 0.9


def test_dropout_masks_differ_between_rank_blocks():
    run_ranks(dropout_blocks, 2)


def group_and_mesh_options(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))
    for options in ({"group": halves[rank // 2]}, {"mesh": mesh}):
        model, args, kwargs = nanogpt.make(seq_len=32)
        reference = copy.deepcopy(model)
        torch.compiler.reset()
        logits, loss = torch.compile(model, backend="ulysses", options={"compiler": "aot_eager", **options})(
            *args, **kwargs
        )
        loss.backward()
        want_logits, want_loss = reference(*args, **kwargs)
        want_loss.backward()
        compare_model(rank, model, reference, {"loss": (loss, want_loss), "logits": (logits, want_logits)})


def test_group_of_two_inside_four_ranks_and_a_mesh():
    run_ranks(group_and_mesh_options, 4)
