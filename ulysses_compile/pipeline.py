"""The ordered passes that turn a captured graph into its Ulysses sequence-parallel version.

Each pass is ``fn(gm, ctx) -> None`` in its own module under ``passes/``; the pipeline times each one,
keeps the graph code after each in the report, and logs it (``TORCH_LOGS="+ulysses_compile"``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist
import torch.fx as fx

from .collectives import COLLECTIVES
from .compat import CompileContext, trace_structured
from .context import PassContext
from .passes.average_data_parallel_grads import average_data_parallel_grads
from .passes.check_local_shapes import check_local_shapes
from .passes.decompose_multi_head_attention import decompose_multi_head_attention
from .passes.detect_attention import detect_attention
from .passes.inline_checkpoint_regions import inline_checkpoint_regions, recompute_inserted_nodes
from .passes.insert_all_to_all import insert_all_to_all
from .passes.localize_ops import localize_ops
from .passes.propagate_sharding import propagate_sharding
from .passes.recognize_causal_mask import recognize_causal_mask
from .passes.recognize_flash_attention import recognize_flash_attention
from .passes.redistribute import redistribute
from .passes.regather_parameters import regather_parameters
from .report import Collective

log = logging.getLogger("ulysses_compile")

PASSES = (
    inline_checkpoint_regions,
    decompose_multi_head_attention,
    recognize_flash_attention,
    recognize_causal_mask,
    detect_attention,
    propagate_sharding,
    redistribute,
    average_data_parallel_grads,
    regather_parameters,
    insert_all_to_all,
    localize_ops,
    check_local_shapes,
    recompute_inserted_nodes,
)


# What a graph that is not split still needs (its checkpointed regions opened, as the tags are this
# backend's; a data-parallel mesh averages its gradients; ZeRO-3). Opening regions twice is harmless.
REPLICATED_PASSES = (inline_checkpoint_regions, average_data_parallel_grads, regather_parameters)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.world_size == 1:
        ctx.report.replicated = "the sequence-parallel group has 1 rank (data parallelism only)"
        _run_replicated(gm, ctx)
    else:
        for graph_pass in PASSES:
            _run(graph_pass, gm, ctx)
            if graph_pass is detect_attention and _runs_replicated(ctx):
                _run_replicated(gm, ctx)
                break
    _record_collectives(gm, ctx)
    for fallback in ctx.report.fallbacks:
        log.info("ulysses_compile: fallback %s", fallback)
    _dump(ctx)
    return gm


def _dump(ctx: PassContext) -> None:
    """The graph's code before and after each pass and the report: as artifacts in torch's structured
    trace (``TORCH_TRACE=DIR``, read with tlparse), and as files under ``options["dump_dir"]``."""
    report = ctx.report
    pieces = {"captured": report.captured, **report.graphs}
    for name, code in pieces.items():
        trace_structured("artifact", metadata_fn=lambda name=name: {"name": f"ulysses_compile_{name}",
                                                                     "encoding": "string"},
                         payload_fn=lambda code=code: code)
    trace_structured("artifact", metadata_fn=lambda: {"name": "ulysses_compile_report", "encoding": "string"},
                     payload_fn=lambda: str(report))
    if ctx.options.dump_dir is None:
        return
    compile_id = str(CompileContext.current_compile_id() or "graph").replace("/", "_")
    # the global rank: on a ("dp", "sp") mesh the replicas' sequence groups have ranks of the same numbers
    rank = dist.get_rank() if dist.is_initialized() else ctx.rank
    folder = Path(ctx.options.dump_dir) / f"rank{rank}" / compile_id
    folder.mkdir(parents=True, exist_ok=True)
    for index, (name, code) in enumerate(pieces.items()):
        (folder / f"{index:02d}_{name}.py").write_text(code)
    (folder / "report.txt").write_text(str(report) + "\n")
    log.info("ulysses_compile: graphs and report of compile %s written to %s", compile_id, folder)


def _run_replicated(gm: fx.GraphModule, ctx: PassContext) -> None:
    log.info("ulysses_compile: %s; it runs replicated on every rank", ctx.report.replicated)
    for replicated_pass in REPLICATED_PASSES:
        _run(replicated_pass, gm, ctx)


def _run(graph_pass, gm: fx.GraphModule, ctx: PassContext) -> None:
    started = time.perf_counter()
    graph_pass(gm, ctx)
    ctx.report.pass_seconds[graph_pass.__name__] = time.perf_counter() - started
    gm.recompile()
    ctx.report.graphs[graph_pass.__name__] = gm.code
    log.debug("ulysses_compile: graph after %s:\n%s", graph_pass.__name__, gm.code)


def _runs_replicated(ctx: PassContext) -> bool:
    """A graph without attention, or whose sequences are shorter than the ranks (blocks would be empty,
    and a compiler may drop the collectives of an empty block on some ranks only), is computed whole
    on every rank: exact, and at such lengths nothing is gained by splitting."""
    if not ctx.sites:
        ctx.report.replicated = "no attention in this graph"
    # For a symbolic length this comparison becomes a guard: a shorter call compiles its own graph.
    short = [length for site in ctx.sites for length in (site.seq_len, site.kv_seq_len) if length < ctx.world_size]
    if short:
        ctx.report.replicated = (f"a sequence of {short[0]} positions is shorter than the {ctx.world_size} "
                                 f"sequence-parallel ranks")
    return bool(ctx.report.replicated)


def _record_collectives(gm: fx.GraphModule, ctx: PassContext) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            meta = node.args[0].meta  # a replicated graph has Dynamo's example values only
            value = meta.get("val", meta.get("example_value"))
            ctx.report.collectives.append(
                Collective(node.target.__name__, node.name, tuple(value.shape), str(value.dtype))
            )
