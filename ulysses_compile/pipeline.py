"""The ordered passes that turn a captured graph into its Ulysses sequence-parallel version.

Each pass is ``fn(gm, ctx) -> None`` in its own module under ``passes/``; the pipeline times each one,
keeps the graph code after each in the report, and logs it (``TORCH_LOGS="+ulysses_compile"``).
"""

from __future__ import annotations

import logging
import time

import torch.fx as fx

from .collectives import COLLECTIVES
from .context import PassContext
from .passes.check_local_shapes import check_local_shapes
from .passes.decompose_multi_head_attention import decompose_multi_head_attention
from .passes.detect_attention import detect_attention
from .passes.insert_all_to_all import insert_all_to_all
from .passes.localize_ops import localize_ops
from .passes.propagate_sharding import propagate_sharding
from .passes.recognize_flash_attention import recognize_flash_attention
from .passes.redistribute import redistribute
from .report import Collective

log = logging.getLogger("ulysses_compile")

PASSES = (
    decompose_multi_head_attention,
    recognize_flash_attention,
    detect_attention,
    propagate_sharding,
    redistribute,
    insert_all_to_all,
    localize_ops,
    check_local_shapes,
)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for graph_pass in PASSES:
        started = time.perf_counter()
        graph_pass(gm, ctx)
        ctx.report.pass_seconds[graph_pass.__name__] = time.perf_counter() - started
        if graph_pass is detect_attention and not ctx.sites:
            log.info("ulysses_compile: no attention in this graph; it runs replicated on every rank")
            return gm
        gm.recompile()
        ctx.report.graphs[graph_pass.__name__] = gm.code
        log.debug("ulysses_compile: graph after %s:\n%s", graph_pass.__name__, gm.code)
    _record_collectives(gm, ctx)
    for fallback in ctx.report.fallbacks:
        log.info("ulysses_compile: fallback %s", fallback)
    return gm


def _record_collectives(gm: fx.GraphModule, ctx: PassContext) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            value = node.args[0].meta.get("val")
            ctx.report.collectives.append(
                Collective(node.target.__name__, node.name, tuple(value.shape), str(value.dtype))
            )
