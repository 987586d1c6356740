"""The ordered passes that turn a captured graph into its Ulysses sequence-parallel version.

Each pass is a function ``fn(gm, ctx, ...)`` in its own module under ``ulysses_compile/passes/``: it rewrites the graph
in place and returns what it found (attention sites, fallbacks, notes), which only this module writes
into the graph's report. The phases::

    open checkpointed regions, recognize attention forms     (every graph)
    drop dead values, detect attention -> sites              (decides: split, or run replicated)
    propagate placements -> fallbacks                        (split graphs only)
    plan the sequence layout -> contiguous or head-tail
    localize ops, redistribute -> gathered and sharded outputs, tile token losses, tile MLPs,
    average data-parallel gradients, merge ZeRO's gradient reductions, regather parameters,
    return the LM head weight's inputs, all-to-alls around each site, check local shapes, recompute tags

The pipeline times each pass, keeps the graph code after each in the report, and logs it
(``TORCH_LOGS="+ulysses_compile"``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
import torch.fx as fx

from ulysses_compile.core.collectives import COLLECTIVES
from ulysses_compile.core.compat import (
    CHECKPOINTED_SIDE_EFFECTS,
    CompileContext,
    GuardOnDataDependentSymNode,
    copy_graph,
    first_line,
    trace_structured,
)
from ulysses_compile.core.context import PassContext
from ulysses_compile.core.fx_graph import method_or_function_args, mutated_arg
from ulysses_compile.core.random_draws import random_draw
from ulysses_compile.core.report import Collective, GraphReport, module_path
from ulysses_compile.core.ring_attention import ring_attention
from ulysses_compile.core.sharding import RANK_SPECIFIC, REPLICATE, is_sharded, seq_factors, sharding_of
from ulysses_compile.passes.average_data_parallel_grads import average_data_parallel_grads
from ulysses_compile.passes.check_local_shapes import check_local_shapes
from ulysses_compile.passes.decompose_multi_head_attention import decompose_multi_head_attention
from ulysses_compile.passes.detect_attention import AttentionSite, Detection, detect_attention
from ulysses_compile.passes.drop_dead_values import drop_dead_values
from ulysses_compile.passes.inline_checkpoint_regions import inline_checkpoint_regions, recompute_inserted_nodes
from ulysses_compile.passes.insert_all_to_all import insert_all_to_all
from ulysses_compile.passes.keep_cache_on_heads import keep_cache_on_heads
from ulysses_compile.passes.localize_ops import localize_ops
from ulysses_compile.passes.merge_gradient_reductions import merge_gradient_reductions
from ulysses_compile.passes.plan_sequence_layout import plan_sequence_layout
from ulysses_compile.passes.propagate_sharding import LINEAR, propagate_sharding
from ulysses_compile.passes.recognize_causal_convolution import causal_convolutions, recognize_causal_convolution
from ulysses_compile.passes.recognize_causal_mask import recognize_causal_mask
from ulysses_compile.passes.recognize_flash_attention import recognize_flash_attention
from ulysses_compile.passes.redistribute import redistribute
from ulysses_compile.passes.regather_parameters import regather_parameters
from ulysses_compile.passes.return_weight_inputs import return_weight_inputs
from ulysses_compile.passes.split_key_permutes import split_key_permutes
from ulysses_compile.passes.tile_mlp import tile_mlp
from ulysses_compile.passes.tile_token_loss import tile_token_loss

log = logging.getLogger("ulysses_compile")

# The note of a graph decoding on a key/value cache's heads: how its projections split.
PROJECTIONS_ON_HEADS = "projections on the rank's heads"


def run_pipeline(gm: fx.GraphModule, ctx: PassContext) -> GraphReport:
    report = GraphReport(captured=gm.code)
    report.notes += _run(report, inline_checkpoint_regions, gm, ctx)
    if ctx.world_size == 1:
        report.replicated = "the sequence-parallel group has 1 rank (data parallelism only)"
        report.notes += _run(report, recognize_causal_mask, gm, ctx)
    else:
        report.rejected_attention += _run(report, decompose_multi_head_attention, gm, ctx)
        report.rejected_attention += _run(report, recognize_flash_attention, gm, ctx)
        report.notes += _run(report, recognize_causal_mask, gm, ctx)
        _run(report, drop_dead_values, gm, ctx)
        _run(report, recognize_causal_convolution, gm, ctx)
        _run(report, split_key_permutes, gm, ctx)
        detection = _run(report, detect_attention, gm, ctx)
        report.attention_sites = detection.sites
        report.rejected_attention += detection.rejected
        if not detection.sites and ctx.checkpointed_side_effect_break:
            report.notes.append(_broken_checkpointed_region(ctx.checkpointed_side_effect_break))
            _warn_once(report.notes[-1])
        unsplit = copy_graph(gm.graph)
        try:
            report.replicated = _why_replicated(detection, causal_convolutions(gm.graph), ctx)
            if not report.replicated:
                # a note kept only once the split has gone through (a size read from data undoes it)
                report.notes += _split(gm, ctx, detection.sites, report)
        except GuardOnDataDependentSymNode as error:
            gm.graph = unsplit
            report = _sized_by_data(report, error)
            _warn_once(report.replicated)
    if report.replicated:
        report.replicated_draws = _replicated_draws(gm)
        # What a graph that is not split still needs: gradients averaged over a data-parallel mesh,
        # ZeRO-3's re-gathers.
        log.info("ulysses_compile: %s; it runs replicated on every rank", report.replicated)
        _run(report, average_data_parallel_grads, gm, ctx)
        _run(report, regather_parameters, gm, ctx)
    report.collectives = _collectives(gm)
    report.rank_specific = _rank_specific(gm)
    for fallback in report.fallbacks:
        log.info("ulysses_compile: fallback %s", fallback)
    _dump(report, ctx)
    return report


def one_rank_rewrites(gm: fx.GraphModule) -> list[str]:
    """The rewrites a graph compiled for one rank without a report still gets: those exact at any P
    that make it faster (a causal mask built from positions becomes SDPA's causal kernel)."""
    try:
        notes = recognize_causal_mask(gm, None)
    except Exception as error:  # each rewrite is proven before it is made: what was rewritten stays exact
        log.warning("ulysses_compile: the causal-mask recognition failed (%s: %s); the masks it did not "
                    "reach are kept", type(error).__name__, error)
        notes = []
    gm.recompile()
    return notes


def _sized_by_data(report: GraphReport, error: Exception) -> GraphReport:
    """The report of a graph whose split met a size read from data (an ``.item()`` or ``.tolist()`` that
    Dynamo captured) where a decision needs its value: the graph runs whole, as captured."""
    why = (f"a size read from data (.item() or .tolist() in the model) decides how it would be split "
           f"({first_line(str(error))}), which no rank knows before it runs")
    return GraphReport(captured=report.captured, notes=report.notes, replicated=why,
                       rejected_attention=[*report.rejected_attention,
                                           *(f"{site.module}: {why}" for site in report.attention_sites)])


def _split(gm: fx.GraphModule, ctx: PassContext, sites: list[AttentionSite], report: GraphReport) -> list[str]:
    """Run the passes that split the graph, filling ``report``; returns the notes on how it split."""
    propagation = _run(report, propagate_sharding, gm, ctx, sites)
    report.fallbacks, report.off_sequence = propagation.fallbacks, propagation.off_sequence
    report.notes += propagation.whole_operands
    notes = [_projections_on_heads(gm)] if any(site.on_cache_heads for site in sites) else []
    report.convolutions = [module_path(conv) or conv.name for conv in causal_convolutions(gm.graph)
                           if is_sharded(sharding_of(conv).output)]
    report.replicated_draws = _replicated_draws(gm)
    layout = _run(report, plan_sequence_layout, gm, ctx, sites)
    report.head_tail, report.sequence_layout = layout.head_tail, layout.why
    ctx = replace(ctx, head_tail=layout.head_tail)
    _run(report, localize_ops, gm, ctx)
    outputs = _run(report, redistribute, gm, ctx)
    report.gathered_outputs, report.sharded_outputs = outputs.gathered, outputs.sharded
    if outputs.gathered and not ctx.outputs_to_caller:
        report.notes.append(_gathered_at_a_graph_break(ctx.graph_break, ctx.options.outputs))
        _warn_once(report.notes[-1])
    tiled = _run(report, tile_token_loss, gm, ctx, report.sharded_outputs)
    report.notes += tiled.notes
    report.notes += _run(report, tile_mlp, gm, ctx)
    _run(report, average_data_parallel_grads, gm, ctx)
    _run(report, merge_gradient_reductions, gm, ctx)
    _run(report, regather_parameters, gm, ctx)
    report.computed_outputs = _run(report, return_weight_inputs, gm, ctx, tiled.computed)
    _run(report, insert_all_to_all, gm, ctx, sites)
    report.sharded_outputs = _run(report, keep_cache_on_heads, gm, ctx, sites, report.sharded_outputs)
    _run(report, check_local_shapes, gm, ctx)
    _run(report, recompute_inserted_nodes, gm, ctx)
    return notes


def _projections_on_heads(gm: fx.GraphModule) -> str:
    """How many linear layers of a decoding step read the rank's heads' rows of their weights (making q,
    k and v) or columns (the output's partial sums), as propagation placed them."""
    split = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in LINEAR and sharding_of(node) is not None:
            weight = method_or_function_args(node, ("input", "weight"))["weight"]
            factors = seq_factors(sharding_of(node).inputs.get(weight, REPLICATE))
            split[factors[0] if factors else None] += 1
    return (f"{PROJECTIONS_ON_HEADS}: {split[0]} linear layer(s) read the rank's heads' rows of their weights "
            f"(q, k, v), {split[1]} its columns (the attention's output: partial sums, all-reduced); "
            f"{split[None]} read their whole weights")


def _replicated_draws(gm: fx.GraphModule) -> list[str]:
    """The random draws whose values some op reads whole (not sliced to the rank's block): in a graph
    computed whole, every draw. Ranks whose generators differ would read different values there, where
    a draw sliced by every reader gives independent blocks, as one device's draw would."""
    found = []
    for node in gm.graph.nodes:
        if random_draw(node) is None:
            continue
        written = mutated_arg(node)  # a draw in place (noise.uniform_()): its readers read the tensor written
        drawn = [node, written] if isinstance(written, fx.Node) else [node]
        readers = [(user, value) for value in drawn for user in value.users if user is not node]
        sharding = sharding_of(node)
        if sharding is not None and (is_sharded(sharding.output) or all(
                is_sharded((sharding_of(user).inputs if sharding_of(user) else {}).get(value)) for user, value in readers)):
            continue
        found.append(f"{node.name} ({node.target if isinstance(node.target, str) else node.target.__name__})"
                     + (f" at {module_path(node)}" if module_path(node) else ""))
    return found


def _broken_checkpointed_region(reason: str) -> str:
    """Why a graph has no attention when Dynamo could not trace a checkpointed region, and the fix."""
    return (f"Dynamo broke a graph at Python state mutated inside a higher-order op ({reason}), as in a "
            f"checkpointed region such as transformers 5.25's decoder layers (its kernel hub sets a context "
            f"variable in every attention call): the region runs outside the compiled graphs, on the whole "
            f"sequence on every rank, and its attention is not parallelized. torch.compile(model, "
            f"backend=\"ulysses\") by name, parallelize() and explain() trace such regions whole; a backend "
            f"passed as a function (or a function wrapping it) is compiled without the backend's context: pass "
            f"the name, or set torch._dynamo.config.{CHECKPOINTED_SIDE_EFFECTS} = True around the calls (the "
            f"mutation then runs once per call, where eager checkpointing runs it again in the backward's "
            f"recomputation)")


def _gathered_at_a_graph_break(reason: str, outputs: str) -> str:
    """What a graph break after the attention costs where values cross it gathered, and how to avoid it.
    ``reason``: Dynamo's, where this graph ends at the break itself; a graph that returns into a frame
    Dynamo resumes after a break deeper in the model (transformers' decoder layers) has none."""
    where = f"it ends at a graph break: {reason}" if reason else "the code it returns to runs on before the caller reads them, as after a graph break"
    logging_hint = (" A logging call breaks the graph: transformers warns about use_cache under gradient "
                    "checkpointing, so call the model with use_cache=False (or set model.config.use_cache = False); "
                    "for other loggers add the method to torch._dynamo.config.ignore_logging_functions")
    return (f"this graph's sequence-sharded outputs are gathered on every rank ({where}), and a graph after it "
            f"that holds no attention (an LM head and its loss: [S, vocab] logits) runs on the whole sequence on "
            f"every rank. Remove the graph break (TORCH_LOGS=graph_breaks shows it)"
            + (f", or leave option outputs at its default \"lazy\" (not {outputs!r}), which passes the rank's block "
               f"across it." if outputs != "lazy" else ".")
            + (logging_hint if not reason or "Logger" in reason else ""))


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("ulysses_compile: %s", message)


def _dump(report: GraphReport, ctx: PassContext) -> None:
    """The graph's code before and after each pass and the report: as artifacts in torch's structured
    trace (``TORCH_TRACE=DIR``, read with tlparse), and as files under ``options["dump_dir"]``."""
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


def _run(report: GraphReport, graph_pass, gm: fx.GraphModule, ctx: PassContext, *found):
    started = time.perf_counter()
    result = graph_pass(gm, ctx, *found)
    report.pass_seconds[graph_pass.__name__] = time.perf_counter() - started
    gm.recompile()
    report.graphs[graph_pass.__name__] = gm.code
    log.debug("ulysses_compile: graph after %s:\n%s", graph_pass.__name__, gm.code)
    return result


def _why_replicated(detection: Detection, convolutions: list[fx.Node], ctx: PassContext) -> str:
    """A graph without attention or causal convolutions, or whose sequences are shorter than the ranks
    (blocks would be empty, and a compiler may drop the collectives of an empty block on some ranks
    only), is computed whole on every rank: exact, and at such lengths nothing is gained by splitting. A
    graph that receives sequence-sharded values a graph before it left lazily (the hidden states and
    router logits after a graph break) runs on those blocks, with or without attention."""
    sites, world_size = detection.sites, ctx.world_size
    if not sites and (ctx.lazy_inputs or convolutions):
        short = [conv.args[0].meta["example_value"].shape[-1] for conv in convolutions]
        short = [length for length in short if length < world_size]
        return f"a sequence of {short[0]} positions is shorter than the {world_size} sequence-parallel ranks" \
            if short and not ctx.lazy_inputs else ""
    if not sites and detection.rejected:
        more = f" (and {len(detection.rejected) - 1} more rejected)" if len(detection.rejected) > 1 else ""
        return f"no attention in this graph is parallelized: {detection.rejected[0]}{more}"
    if not sites:
        return "no attention in this graph"
    # For a symbolic length this comparison becomes a guard: a shorter call compiles its own graph.
    short = [length for site in sites if not site.on_cache_heads
             for length in (site.seq_len, site.kv_seq_len) if length < world_size]
    if short:
        return f"a sequence of {short[0]} positions is shorter than the {world_size} sequence-parallel ranks"
    return ""


def _rank_specific(gm: fx.GraphModule) -> list[str]:
    """The nodes whose code holds this rank's number: calls given it as their ``rank`` (not the rank
    read at run time) and the indexing a rule split by rank (``RANK_SPECIFIC``)."""
    found = []
    for node in gm.graph.nodes:
        signature = _takes_rank(node.target) if node.op == "call_function" else None
        rank = signature.bind(*node.args, **node.kwargs).arguments["rank"] if signature else None
        if isinstance(rank, int) or node.meta.get(RANK_SPECIFIC):
            found.append(node.name)
    return found


@functools.cache
def _takes_rank(target) -> inspect.Signature | None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin, or a torch op: no Python signature, no rank
        return None
    return signature if "rank" in signature.parameters else None


def _collectives(gm: fx.GraphModule) -> list[Collective]:
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.target in COLLECTIVES or node.target is ring_attention):
            meta = node.args[0].meta  # a replicated graph has Dynamo's example values only
            value = meta.get("val", meta.get("example_value"))
            found.append(Collective(node.target.__name__, node.name, tuple(value.shape), str(value.dtype)))
    return found
