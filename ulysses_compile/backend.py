"""The ``ulysses`` torch.compile backend: options -> pipeline -> inner compiler."""

from __future__ import annotations

import contextlib
import copy
import dis
import functools
import inspect
import logging
import sys

import torch
import torch.fx as fx

from ulysses_compile.agreement import InputCheck, fingerprint, guarded, input_names, program_digest
from ulysses_compile.compiled_calls import CompiledCall, counted
from ulysses_compile.core.boundary import leave_sharded, refuse_dtensor_inputs
from ulysses_compile.core.collectives import gather_parameter
from ulysses_compile.core.compat import (
    CompileContext,
    aot_autograd,
    boxed_nop,
    checkpointed_side_effect_break,
    compile_fx,
    graph_break_reason,
    list_mode_options,
    min_cut_rematerialization_partition,
    no_graph_cse,
    orig_code_map,
)
from ulysses_compile.core.context import PassContext
from ulysses_compile.core.errors import UnsupportedError
from ulysses_compile.core.options import Options
from ulysses_compile.core.report import GraphReport, layer_of
from ulysses_compile.core.sharding import SHARDS
from ulysses_compile.passes.bucket_zero_gathers import BucketZeroGathers, zero_unit
from ulysses_compile.passes.pipeline import one_rank_rewrites, run_pipeline
from ulysses_compile.verify import verified, verified_short

log = logging.getLogger("ulysses_compile")


def ulysses(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    """``torch.compile(model, backend="ulysses", options={...})`` lands here once per captured graph."""
    opts = Options.parse(options)
    group = opts.process_group()
    data_parallel = _data_parallel(opts)
    if group is None or (group.size() == 1 and data_parallel is None):
        log.info(
            "ulysses_compile: %s; compiling with %s as torch.compile would, causal masks recognized",
            "torch.distributed is not initialized" if group is None else "the process group has 1 rank",
            opts.compiler,
        )
        for note in one_rank_rewrites(gm):
            log.info("ulysses_compile: %s", note)
        return counted(inner_compile(gm, example_inputs, opts.compiler, mode), sites=0, world_size=1)
    _check_one_device(gm, example_inputs)
    refuse_dtensor_inputs(input_names(gm), example_inputs)
    original = copy.deepcopy(gm) if opts.verify else None
    expected = fingerprint(gm, example_inputs)
    ctx, report = rewrite(gm, example_inputs, opts, group)
    graph_name = f"compiled graph {CompileContext.current_compile_id()}"
    check = _input_check(gm, ctx, group, graph_name, expected, report.replicated_draws, opts.rank_wait_warning) \
        if opts.check_inputs and group.size() > 1 else None
    compiled = inner_compile(gm, example_inputs, opts.compiler, mode, merge_equal_nodes=not report.rank_specific)
    if opts.verify == "short":
        compiled = verified_short(compiled, original, gm, ctx, example_inputs)
    elif opts.verify:
        compiled = verified(compiled, original, gm, ctx)
    compiled = leave_sharded(compiled, report.sharded_outputs, report.computed_outputs, opts, group, graph_name,
                             program_digest(expected))
    sites = 0 if report.replicated else len(report.attention_sites) + len(report.convolutions) + len(report.off_sequence)
    state = _module_state(gm, ctx) if group.size() > 1 else []
    return counted(guarded(compiled, expected, group, ctx.rank, graph_name, check, state, opts.sync_module_states),
                   sites, ctx.world_size)


def _module_state(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[int, str]]:
    """The positions and names of the graph's parameter and buffer inputs, not ZeRO shards (each rank's
    own rows)."""
    names = input_names(gm)
    return [(position, names[position]) for position, node in enumerate(gm.graph.find_nodes(op="placeholder"))
            if node in ctx.parameters and f"_dict{SHARDS}_" not in node.target]


ulysses.backend_ctx_ctor = CompiledCall


def _input_check(gm: fx.GraphModule, ctx: PassContext, group, graph_name: str, expected: dict, draws: list[str],
                 wait_warning: float | None) -> InputCheck:
    """The check of every call's place and user inputs (not parameters, buffers or ZeRO shards) across the
    group, and of the random generator's state where the graph reads random draws whole (``draws``)."""
    names = input_names(gm)
    positions = [i for i, node in enumerate(gm.graph.find_nodes(op="placeholder")) if node not in ctx.parameters]
    return InputCheck([names[i] for i in positions], positions, group, ctx.rank, graph_name, expected, draws,
                      wait_warning)


def rewrite(gm: fx.GraphModule, example_inputs, opts: Options, group) -> tuple[PassContext, GraphReport]:
    """Run the passes on ``gm`` in place for this rank of ``group``; the report is also kept in
    ``gm.meta["ulysses_report"]``."""
    group_name = opts.group_name()
    lazy_inputs, lazy_head_tail = PassContext.lazy_placeholders(gm, example_inputs, group, group_name)
    ctx = PassContext(
        world_size=group.size(),
        rank=group.rank(),
        group_name=group_name,
        options=opts,
        parameters=PassContext.parameter_placeholders(gm, example_inputs),
        data_parallel=_data_parallel(opts),
        outputs_to_caller=returns_to_compile_caller(gm),
        graph_break=graph_break_reason(gm),
        checkpointed_side_effect_break=checkpointed_side_effect_break(),
        lazy_inputs=lazy_inputs,
        lazy_head_tail=lazy_head_tail,
    )
    report = run_pipeline(gm, ctx)
    gm.meta["ulysses_report"] = report
    return ctx, report


def returns_to_compile_caller(gm) -> bool:
    """Whether the graph being compiled hands its outputs straight to the code that called the
    ``torch.compile``-d function or module, and nothing else, compiled or eager, reads them first.

    Dynamo compiles a graph at a frame's return or at a graph break (``compile_subgraph_reason``). At a
    return, the frame's callers are walked from Dynamo's frame callback up: ``nn.Module`` call machinery
    and Dynamo-transformed frames that return the call's result at once pass it on; reaching
    ``torch.compile``'s entry (``eval_frame.py``) means the caller is the user's. Anything else (eager
    code between graphs, a transformed frame that continues after the call) reads it first."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break:
        return False
    frame, caller = sys._getframe(1), None
    while frame is not None:  # the caller of the frame being compiled: above Dynamo's outermost callback frame
        if frame.f_code.co_filename.endswith("torch/_dynamo/convert_frame.py"):
            caller = frame.f_back
        frame = frame.f_back
    frame = caller
    while frame is not None:
        code, path = frame.f_code, frame.f_code.co_filename
        if path.endswith("torch/_dynamo/eval_frame.py"):
            return True
        if code in orig_code_map:
            after = [i for i in dis.get_instructions(code) if i.offset > frame.f_lasti and i.opname != "CACHE"]
            if not after or after[0].opname != "RETURN_VALUE":
                return False
        elif not path.endswith("torch/nn/modules/module.py"):
            return False
        frame = frame.f_back
    return False


def _check_one_device(gm: fx.GraphModule, example_inputs) -> None:
    """Inputs on another device than the parameters; some ops (an embedding lookup) trace anyway."""
    by_device: dict[str, list[str]] = {}
    for name, value in zip(input_names(gm), example_inputs):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            by_device.setdefault(str(value.device), []).append(name)
    if len(by_device) > 1:
        where = "; ".join(f"{device}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                          for device, names in by_device.items())
        raise UnsupportedError(
            f"the graph's inputs and parameters are on {len(by_device)} devices ({where}); move the inputs to "
            f"the parameters' device (tensor.to(device), model.to(device)) before calling the compiled model"
        )


def _data_parallel(opts: Options) -> tuple[str, int] | None:
    group = opts.data_parallel_group()
    return (opts.data_parallel_group_name(), group.size()) if group is not None and group.size() > 1 else None


BUCKET_MIB = 25.0  # DDP's bucket, for ZeRO's collectives in a graph without numbered layers
_GATHER_SIGNATURE = inspect.signature(gather_parameter)


def bucketing(gm: fx.GraphModule) -> dict:
    """Inductor's bucketing of collectives that run one after another in graph order (the same on every
    rank): the gradients' all-reduces in one bucket (every gradient is kept anyway); ZeRO's parameter
    all-gathers one per layer (``ulysses_compile/passes/regather_parameters.py`` marked each with its layer), as FSDP
    gathers a wrapped layer at once, where its first parameter is read; ZeRO's reduce-scatters (no other
    op reduce-scatters) in buckets of the largest layer's gradients, so a full gradient lives until its
    bucket's reduce-scatter, not the whole step. The results are the same elementwise; the ranks meet
    fewer times."""
    reduce_mib = functools.partial(_constant, reduce_scatter_bucket_mib(gm))
    return {"bucket_all_reduces_fx": "all", "bucket_reduce_scatters_fx": "all",
            "bucket_reduce_scatters_fx_bucket_size_determinator": reduce_mib,
            "post_grad_custom_post_pass": BucketZeroGathers()}


def reduce_scatter_bucket_mib(gm: fx.GraphModule) -> float:
    """MiB of the largest layer's gradients as reduce-scattered (padded to equal shards, in the
    reduction's dtype; a byte more, as Inductor rounds the cap); DDP's bucket without numbered layers."""
    layers: dict[str, int] = {}
    for node in gm.graph.find_nodes(op="call_function", target=gather_parameter):
        unit = zero_unit(node)
        arguments = _GATHER_SIGNATURE.bind(*node.args, **node.kwargs).arguments
        local = arguments["local"].meta.get("example_value", arguments["local"].meta.get("val"))
        dtype = arguments.get("reduce_dtype") or arguments.get("param_dtype") or local.dtype
        if unit is not None and layer_of(unit) == unit:
            layers[unit] = layers.get(unit, 0) + local.numel() * arguments["group_size"] * dtype.itemsize
    return (max(layers.values()) + 1) / 2**20 if layers else BUCKET_MIB


def _constant(value: float, index: int) -> float:
    return value


def inner_compile(gm: fx.GraphModule, example_inputs, compiler: str, mode: str | None = None,
                  merge_equal_nodes: bool = True):
    """``merge_equal_nodes``: AOTAutograd's CSE, off for a graph whose code holds this rank's number
    (``GraphReport.rank_specific``; ``compat.no_graph_cse`` says why)."""
    if compiler == "inductor":
        patches = {**bucketing(gm), **(list_mode_options(mode) if mode else {})}
        with contextlib.nullcontext() if merge_equal_nodes else no_graph_cse():
            return compile_fx(gm, example_inputs, config_patches=patches)
    if compiler == "aot_eager":
        return aot(boxed_nop, boxed_nop, merge_equal_nodes)(gm, example_inputs)
    return gm.forward


def aot(fw_compiler, bw_compiler, merge_equal_nodes: bool = True):
    """AOTAutograd with Inductor's partitioner, so aot_eager saves and recomputes what Inductor would
    (ZeRO-3 re-gathers), and merges equal nodes where compile_fx would."""
    compile_joint = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                 partition_fn=min_cut_rematerialization_partition)
    if merge_equal_nodes:
        return compile_joint

    def compile_without_cse(gm: fx.GraphModule, example_inputs):
        with no_graph_cse():
            return compile_joint(gm, example_inputs)

    return compile_without_cse

