"""Activation checkpointing keeps sequence parallelism: the attention inside checkpointed regions is
found and parallelized, the backward recomputes the regions (their all-to-alls included), and loss,
logits and every gradient equal eager's."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import transformers
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import nanogpt
from graphs import reporting_backend
from models import token_batch, tiny_llama
from multirank import compare_model, run_ranks
from ulysses_compile import explain, parallelize
from ulysses_compile.backend import ulysses
from ulysses_compile.core.collectives import heads_to_seq, seq_to_heads_qkv
from ulysses_compile.core.compat import (
    CHECKPOINTED_SIDE_EFFECTS,
    ulysses_tracing,
    dynamo_counters,
    run_and_get_code,
)

LAYERS = 2


@functools.cache
def _recording(attention: type) -> type:
    def forward(self, *args, **kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        self.last_length = hidden_states.shape[1]
        return attention.forward(self, *args, **kwargs)

    return type(f"Recording{attention.__name__}", (attention,), {"forward": forward, "last_length": None})


def record_attention_lengths(model: nn.Module) -> nn.Module:
    """Every attention module records the length it last saw, for logging: Python state mutated inside
    the checkpointed region, as transformers 5.25's kernel hub mutates some in every attention call."""
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.__class__ = _recording(type(module))
    return model


def checkpointed_llama(enabled: bool = True, intermediate_size: int | None = None, recording: bool = False):
    model = tiny_llama(heads=8, kv_heads=4, layers=LAYERS, intermediate_size=intermediate_size)
    if recording:
        record_attention_lengths(model)
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, labels = token_batch(seq=64)
    return model, (), {"input_ids": ids, "labels": labels, "use_cache": False}


@functools.cache
def _printing(attention: type) -> type:
    def forward(self, *args, **kwargs):
        output = attention.forward(self, *args, **kwargs)
        print(f"attention output {tuple(output.shape)}")  # Dynamo breaks the graph here
        return output

    return type(f"Printing{attention.__name__}", (attention,), {"forward": forward})


def checkpointed_nanogpt(enabled: bool = True, impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                         recording: bool = False, printing: bool = False):
    """torch's own wrapper, as FSDP recipes apply it to every block. ``printing``: each attention prints,
    a graph break inside the checkpointed region."""
    model, args, kwargs = nanogpt.make(seq_len=64, n_layer=LAYERS)
    if recording:
        record_attention_lengths(model)
    for module in model.modules() if printing else ():
        if type(module).__name__.endswith("Attention"):
            module.__class__ = _printing(type(module))
    if enabled:
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
                                   check_fn=lambda module: isinstance(module, nanogpt.Block))
    return model, args, kwargs


def _loss(result):
    return result.loss if hasattr(result, "loss") else result[1]


def _logits(result):
    return result.logits if hasattr(result, "logits") else result[0]


@pytest.mark.parametrize("make", [checkpointed_llama, checkpointed_nanogpt], ids=["llama", "nanogpt"])
def test_checkpointed_attention_is_parallelized_and_recomputed(make):
    model, args, kwargs = make()
    report = explain(model, *args, world_size=2, **kwargs)
    assert len(report.attention_sites) == LAYERS and not report.graphs[0].replicated
    assert all(site.decision.endswith("in a checkpointed region (recomputed in the backward)")
               for site in report.attention_sites)
    totals = report.totals()
    assert totals[("forward", "all_to_all")][0] == 2 * LAYERS  # q, k, v to heads in one; the output back
    # the backward recomputes each region's two all-to-alls and sends its own two back
    assert totals[("backward", "all_to_all")][0] == 4 * LAYERS
    unchecked = explain(make(enabled=False)[0], *args, world_size=2, **kwargs)
    assert report.memory.at().saved < unchecked.memory.at().saved / 2


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="transformers 4 warns about use_cache once, before the decoder layers")
def test_the_use_cache_graph_break_under_checkpointing_passes_the_ranks_blocks(caplog):
    """transformers' use_cache warning under gradient checkpointing breaks the graph (Dynamo does not
    trace ``logger.warning_once``): the decoders' output crosses the break as the rank's block and the LM
    head and loss run on it, nothing gathered and nothing to warn about."""
    from ulysses_compile.passes.pipeline import _warn_once

    _warn_once.cache_clear()  # a warning is logged once per process
    model, args, kwargs = checkpointed_llama()
    kwargs.pop("use_cache")
    with caplog.at_level(logging.WARNING, logger="ulysses_compile"):
        report = explain(model, *args, world_size=2, **kwargs)
    assert len(report.attention_sites) == LAYERS and len(report.graphs) == 2, str(report)
    assert [graph.replicated for graph in report.graphs] == ["", ""]
    assert [graph.gathered_outputs for graph in report.graphs] == [[], []] and report.fallbacks == []
    assert not [r for r in caplog.records if "gathered on every rank" in r.getMessage()]
    whole = explain(model, *args, world_size=2, use_cache=False, **kwargs)
    assert len(whole.graphs) == 1


@pytest.mark.parametrize("make", [checkpointed_llama, checkpointed_nanogpt], ids=["llama", "nanogpt"])
def test_a_checkpointed_region_that_mutates_state_is_traced_whole(make):
    """Dynamo cannot replay a Python side effect in the backward's recomputation, so by default it breaks
    the graph inside such a region and runs the region outside the compiled graphs: unsharded. explain
    and parallelize trace it whole (the side effect then runs once per call), and leave Dynamo's setting
    as they found it, also when the call fails."""
    model, args, kwargs = make(recording=True)
    report = explain(model, *args, world_size=2, **kwargs)
    assert not report.graph_breaks and len(report.graphs) == 1 and not report.graphs[0].replicated
    assert len(report.attention_sites) == LAYERS
    totals = report.totals()
    assert totals[("forward", "all_to_all")][0] == 2 * LAYERS and totals[("backward", "all_to_all")][0] == 4 * LAYERS
    assert not getattr(torch._dynamo.config, CHECKPOINTED_SIDE_EFFECTS)
    floats = [value.float() if isinstance(value, torch.Tensor) else value for value in args]
    with pytest.raises(RuntimeError, match="Long"):  # the embedding refuses float token ids
        parallelize(model, zero_stage=0)(*floats, **{name: value.float() if isinstance(value, torch.Tensor)
                                                     else value for name, value in kwargs.items()})
    assert not getattr(torch._dynamo.config, CHECKPOINTED_SIDE_EFFECTS)


def test_a_graph_break_in_a_checkpointed_region_under_torch_compile_is_reported_with_its_fix(fake_group, caplog):
    """With torch.compile itself the break happens; the graphs left without attention say why, once in
    the log, with the setting that removes the break."""
    from ulysses_compile.passes.pipeline import _warn_once

    _warn_once.cache_clear()
    fake_group(2)
    model, args, kwargs = checkpointed_llama(recording=True)
    reports = []
    try:
        with caplog.at_level(logging.WARNING, logger="ulysses_compile"):
            torch.compile(model, backend=reporting_backend(reports))(*args, **kwargs)
        assert reports and not any(report.attention_sites for report in reports)
        warned = [r.getMessage() for r in caplog.records if "inside a higher-order op" in r.getMessage()]
        assert len(warned) == 1 and f"{CHECKPOINTED_SIDE_EFFECTS} = True" in warned[0], warned
        assert all(warned[0].removeprefix("ulysses_compile: ") in report.notes for report in reports)
        torch.compiler.reset()
        reports.clear()
        with ulysses_tracing():
            torch.compile(model, backend=reporting_backend(reports))(*args, **kwargs)
        (report,) = reports
        assert len(report.attention_sites) == LAYERS and not report.replicated
        assert not any("higher-order op" in note for note in report.notes), report.notes
    finally:
        dynamo_counters.clear()  # the break would be reported again by later graphs of this process


def _dynamo_settings() -> dict:
    return {key: value for key, value in torch._dynamo.config.get_config_copy().items() if not callable(value)}


def test_bare_torch_compile_traces_such_a_region_whole_for_its_own_model_only(fake_group, tmp_path):
    """``torch.compile(model, backend="ulysses")`` by name, no setting made: Dynamo traces the region
    whole for this model's calls (the backend's context, entered around each call), and leaves its
    configuration as it was; a model compiled afterwards by plain torch.compile (Inductor) still breaks
    its graph there, as torch does without this package."""
    import pathlib

    fake_group(2)
    before = _dynamo_settings()
    dynamo_counters.clear()
    model, args, kwargs = checkpointed_nanogpt(recording=True)
    compiled = torch.compile(model, backend="ulysses", options={"compiler": "eager", "dump_dir": str(tmp_path)})
    compiled(*args, **kwargs)
    compiled(*args, **kwargs)  # a cached call enters and leaves the context too
    assert _dynamo_settings() == before
    assert not any("side effect" in reason for reason in dynamo_counters["graph_break"])
    (report,) = pathlib.Path(tmp_path, "rank0").glob("*/report.txt")
    text = report.read_text()
    assert f"attention sites: {LAYERS}" in text and f"seq_to_heads_qkv x{LAYERS}" in text, text
    assert f"heads_to_seq x{LAYERS}" in text and "runs replicated" not in text, text

    plain, args, kwargs = checkpointed_nanogpt(recording=True)
    torch.compile(plain)(*args, **kwargs)
    breaks = [reason for reason in dynamo_counters["graph_break"] if "side effect" in reason]
    assert breaks and _dynamo_settings() == before, breaks
    dynamo_counters.clear()  # the break would be reported again by later graphs of this process


def test_a_call_that_parallelizes_no_attention_says_so_once_on_rank_0(fake_group, caplog):
    """A graph break inside a checkpointed region: Dynamo runs the whole region eagerly, so no graph of
    ours holds the attention (the backend may never be called). The call says so, with the break."""
    from ulysses_compile.compiled_calls import _warn_once

    _warn_once.cache_clear()
    fake_group(2)
    model, args, kwargs = checkpointed_nanogpt(printing=True)
    try:
        with caplog.at_level(logging.WARNING, logger="ulysses_compile"):
            for _ in range(2):  # two models compiled alike: the second call of each compiles nothing
                compiled = torch.compile(copy.deepcopy(model), backend="ulysses", options={"compiler": "eager"})
                compiled(*args, **kwargs)
                compiled(*args, **kwargs)
        warned = [r.getMessage() for r in caplog.records if "no attention parallelized" in r.getMessage()]
        assert len(warned) == 1 and "Dynamo met graph breaks (Failed to trace builtin operator)" in warned[0], warned
        caplog.clear()
        _warn_once.cache_clear()
        fake_group(2, rank=1)
        with caplog.at_level(logging.WARNING, logger="ulysses_compile"):
            torch.compile(checkpointed_nanogpt(printing=True)[0], backend="ulysses",
                          options={"compiler": "eager"})(*args, **kwargs)
        assert not [r for r in caplog.records if "no attention parallelized" in r.getMessage()]
    finally:
        dynamo_counters.clear()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False).sum()


def _rewritten(model, x, compiler: str = "eager"):
    """``model(x)`` compiled with the ulysses backend (on the fake group): the rewritten graph, the output."""
    graphs = []

    def capture(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options={"compiler": compiler})
        graphs.append(gm)
        return compiled

    output = torch.compile(model, backend=capture)(x)
    (gm,) = graphs
    return gm, output


def test_checkpointed_region_is_inlined(fake_group):
    fake_group(2)
    gm, _ = _rewritten(Checkpointed(), torch.randn(1, 8, 8))
    code = gm.meta["ulysses_report"].graphs["inline_checkpoint_regions"]
    assert_expected_inline(code.strip(), """\
def forward(self, L_x_ : torch.Tensor, L_self_modules_block_modules_qkv_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_block_modules_qkv_parameters_bias_ : torch.nn.parameter.Parameter):
    l_x_ = L_x_
    l_self_modules_block_modules_qkv_parameters_weight_ = L_self_modules_block_modules_qkv_parameters_weight_
    l_self_modules_block_modules_qkv_parameters_bias_ = L_self_modules_block_modules_qkv_parameters_bias_
    linear = torch._C._nn.linear(l_x_, l_self_modules_block_modules_qkv_parameters_weight_, l_self_modules_block_modules_qkv_parameters_bias_);  l_x_ = l_self_modules_block_modules_qkv_parameters_weight_ = l_self_modules_block_modules_qkv_parameters_bias_ = None
    view = linear.view(1, 8, 3, 2, 4);  linear = None
    permute = view.permute(2, 0, 3, 1, 4);  view = None
    q = permute[0]
    k = permute[1]
    v = permute[2];  permute = None
    scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal = True);  q = k = v = None
    transpose = scaled_dot_product_attention.transpose(1, 2);  scaled_dot_product_attention = None
    flatten = transpose.flatten(2);  transpose = None
    sum_1 = flatten.sum();  flatten = None
    return (sum_1,)""")
    tagged = {node.name: node.meta.get("ac_graph_id") for node in gm.graph.nodes}
    assert tagged["scaled_dot_product_attention"] == 1 and tagged.get("sum_1") is None
    policies = {node.name: node.meta.get("recompute") for node in gm.graph.nodes}
    assert policies["scaled_dot_product_attention"] == CheckpointPolicy.PREFER_RECOMPUTE
    assert policies["flatten"] == CheckpointPolicy.MUST_SAVE  # the region's output, read after it
    collectives = [node for node in gm.graph.nodes if node.target in (seq_to_heads_qkv, heads_to_seq)]
    assert [node.target for node in collectives] == [seq_to_heads_qkv, heads_to_seq]
    assert all(node.meta["ac_graph_id"] == 1 for node in collectives)
    items = list(collectives[0].users)  # q, k and v taken out of the one all-to-all's result
    assert len(items) == 3 and all(item.meta["ac_graph_id"] == 1 for item in items)


class NestedCheckpointed(nn.Module):
    """A checkpointed module that checkpoints its own block again."""

    def __init__(self):
        super().__init__()
        self.inner = Checkpointed()

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def test_nested_regions_are_opened_into_one(fake_group):
    fake_group(2)
    gm, output = _rewritten(NestedCheckpointed(), torch.randn(1, 8, 8, requires_grad=True), "aot_eager")
    output.backward()
    assert len(gm.meta["ulysses_report"].attention_sites) == 1
    assert not [node for node in gm.graph.nodes if node.op == "get_attr" or "checkpoint" in str(node.target)]
    assert {node.meta.get("ac_graph_id") for node in gm.graph.nodes if node.op == "call_function"} == {1, None}
    saved = [node.name for node in gm.graph.nodes if node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE]
    assert saved == ["sum_1"]  # the outer region's output; the inner one's, read inside it, is recomputed


class SelectivelyCheckpointed(Checkpointed):
    """Selective checkpointing: a policy saves the matmuls and recomputes the rest."""

    def forward(self, x):
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=context).sum()


def test_selective_checkpointing_is_recomputed_whole_and_reported(fake_group):
    fake_group(2)
    gm, _ = _rewritten(SelectivelyCheckpointed(), torch.randn(1, 8, 8))
    report = gm.meta["ulysses_report"]
    assert len(report.attention_sites) == 1 and not report.replicated
    assert report.notes == ["block: selective checkpointing (context_fn) is recomputed whole under sequence "
                            "parallelism"], report.notes
    assert "note: " in str(report)


def checkpointed_equal_to_eager(rank, world_size, make, compiler, folder):
    """The README's flow as written: ``torch.compile(model, backend="ulysses")`` by name, no setting made
    (transformers 5.25's checkpointed layers mutate Python state in every attention call); the report
    written to ``dump_dir`` shows one graph with every site and its all-to-alls."""
    import pathlib

    model, args, kwargs = make()
    reference = copy.deepcopy(model)

    def step():
        result = torch.compile(model, backend="ulysses", options={"compiler": compiler, "dump_dir": folder})(
            *args, **kwargs)
        _loss(result).backward()
        return result

    got, codes = run_and_get_code(step)
    assert not getattr(torch._dynamo.config, CHECKPOINTED_SIDE_EFFECTS)
    (report,) = pathlib.Path(folder, f"rank{rank}").glob("*/report.txt")
    text = report.read_text()
    assert f"attention sites: {LAYERS}" in text and "runs replicated" not in text, text
    assert f"seq_to_heads_qkv x{LAYERS}" in text and f"heads_to_seq x{LAYERS}" in text, text
    assert "seq_to_heads x" not in text and "gather_kv_heads" not in text, text
    if compiler == "inductor":
        forward, backward = codes
        assert forward.count("all_to_all_single.default(") == 2 * LAYERS
        assert backward.count("all_to_all_single.default(") == 4 * LAYERS  # two recomputed, two sent back
    want = reference(*args, **kwargs)
    _loss(want).backward()
    compare_model(rank, model, reference, {"loss": (_loss(got), _loss(want)), "logits": (_logits(got), _logits(want))})


CASES = [
    pytest.param(checkpointed_llama, 2, "inductor", id="llama-P2-inductor"),
    pytest.param(checkpointed_llama, 4, "aot_eager", id="llama-P4", marks=pytest.mark.slow),
    pytest.param(checkpointed_nanogpt, 2, "aot_eager", id="nanogpt-P2"),
    pytest.param(functools.partial(checkpointed_nanogpt, recording=True), 2, "aot_eager", id="nanogpt-recording-P2"),
    pytest.param(functools.partial(checkpointed_nanogpt, impl=CheckpointImpl.REENTRANT), 2, "aot_eager",
                 id="nanogpt-reentrant-P2"),
]


@pytest.mark.multirank
@pytest.mark.parametrize("make,world_size,compiler", CASES)
def test_checkpointed_models_equal_to_eager(make, world_size, compiler, tmp_path):
    run_ranks(checkpointed_equal_to_eager, world_size, make, compiler, str(tmp_path))


def checkpointed_zero_trains_like_eager(rank, world_size, stage, recording, folder):
    """Checkpointing and ZeRO together, as long-context training runs: three SGD steps of a checkpointed
    Llama (with MLP weights whose rows do not split evenly; ``recording``: attention that mutates state in
    the region) under parallelize against eager training (every gradient of the first step, the loss of
    each, every parameter after the last; SGD, as Adam would divide rounding noise by its own size);
    the report written to ``dump_dir`` shows the sites and all-to-alls."""
    import pathlib

    from multirank import assert_close
    from ulysses_compile import full_state_dict

    # MLP rows of 50 and 49: rank 1's shards are padded
    model, _, _ = checkpointed_llama(intermediate_size=99, recording=recording)
    reference = copy.deepcopy(model)
    compiled = parallelize(model, zero_stage=stage, compiler="aot_eager", dump_dir=folder)
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    where = f"rank {rank} stage {stage}"
    for step in range(3):
        ids, labels = token_batch(seq=64, seed=step + 1)
        optimizer.zero_grad()
        loss = compiled(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        reference_optimizer.zero_grad()
        eager_loss = reference(input_ids=ids, labels=labels, use_cache=False).loss
        eager_loss.backward()
        assert_close(f"{where} step {step} loss", loss, eager_loss)
        if step == 0:
            for name, param in compiled.named_parameters():
                want = reference.get_parameter(name.removeprefix("_orig_mod.")).grad
                assert_close(f"{where} grad {name}", param.grad.full_tensor(), want)
        optimizer.step()
        reference_optimizer.step()
    trained = full_state_dict(compiled)
    for name, tensor in reference.state_dict().items():
        assert_close(f"{where} {name} after 3 steps", trained[name], tensor)
    (report,) = pathlib.Path(folder, f"rank{rank}").glob("*/report.txt")
    text = report.read_text()
    assert f"attention sites: {LAYERS}" in text and f"seq_to_heads_qkv x{LAYERS}" in text, text
    assert f"heads_to_seq x{LAYERS}" in text and "seq_to_heads x" not in text, text


@pytest.mark.multirank
@pytest.mark.parametrize("stage, recording", [(1, False), (3, True)], ids=["1", "3-recording"])
def test_checkpointing_with_zero_trains_like_eager(stage, recording, tmp_path):
    run_ranks(checkpointed_zero_trains_like_eager, 2, stage, recording, str(tmp_path))


def graph_break_in_checkpointed_region_trains_like_eager(rank, world_size, impl):
    """A graph break inside a checkpointed region of a ZeRO-3 model: Dynamo runs the region eagerly,
    and the backward recomputes it eagerly, reading the partitioned parameters gathered as in the
    forward (reentrant checkpointing differentiates that recomputation: its gradients are reduced as the
    compiled graph's are). At P = 4 on a 2 x 2 ("dp", "sp") mesh each replica has its own batch and the
    gradients are the replicas' average; loss and every gradient equal eager's."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas = world_size // 2
    mesh = init_device_mesh("cpu", (replicas, 2), mesh_dim_names=("dp", "sp")) if replicas > 1 else None
    model, _, _ = checkpointed_nanogpt(impl=impl, printing=True)
    reference = copy.deepcopy(model)
    batches = [nanogpt.make(seq_len=64, n_layer=LAYERS, seed=1 + replica)[1:] for replica in range(replicas)]
    args, kwargs = batches[rank // 2]
    compiled = parallelize(model, zero_stage=3, compiler="aot_eager", mesh=mesh)
    got = compiled(*args, **kwargs)
    _loss(got).backward()
    wants = [reference(*replica_args, **replica_kwargs) for replica_args, replica_kwargs in batches]
    (sum(_loss(want) for want in wants) / replicas).backward()  # DDP: the replicas' gradients averaged
    want = wants[rank // 2]
    compare_model(rank, model, reference, {"loss": (_loss(got), _loss(want)), "logits": (_logits(got), _logits(want))})


@pytest.mark.multirank
@pytest.mark.parametrize("impl,world_size", [(CheckpointImpl.NO_REENTRANT, 2), (CheckpointImpl.REENTRANT, 4)],
                         ids=["non-reentrant-P2", "reentrant-dp2xsp2"])
def test_a_graph_break_inside_a_checkpointed_region_trains_like_eager_under_zero(impl, world_size):
    run_ranks(graph_break_in_checkpointed_region_trains_like_eager, world_size, impl)
