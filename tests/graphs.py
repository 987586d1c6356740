"""Compile a model with the ulysses backend in this process and look at the rewritten graphs."""

from __future__ import annotations

import torch

from ulysses_compile.backend import ulysses


def rewritten_graphs(model, args, kwargs=None, **options):
    """Compile with the ulysses backend (eager inner compiler) and return the rewritten graphs."""
    graphs = []

    def capture(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options={"compiler": "eager", **options})
        graphs.append(gm)
        return compiled

    torch.compile(model, backend=capture)(*args, **(kwargs or {}))
    return graphs


def reporting_backend(reports: list, as_named: bool = False, **options):
    """A backend that compiles with ulysses (aot_eager) and appends each graph's report to ``reports``;
    ``as_named``: with the context Dynamo enters around the calls of ``backend="ulysses"`` (its tracing
    settings), which a backend passed as a function does not get."""

    def backend(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options={"compiler": "aot_eager", **options})
        reports.append(gm.meta["ulysses_report"])
        return compiled

    if as_named:
        from ulysses_compile.core.compat import honour_backend_contexts

        honour_backend_contexts()
        backend.backend_ctx_ctor = ulysses.backend_ctx_ctor
    return backend


def calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def parallelized_graphs(parallelized, kwargs: dict, backward_of=lambda output: output.loss) -> tuple:
    """The rewritten Dynamo graph and the forward and backward graphs AOTAutograd makes of it, for a
    ``parallelize``-d model called once with ``kwargs`` (one process); the model's hooks, which hand the
    graph its local shards, are kept."""
    import torch.distributed as dist

    from ulysses_compile.backend import aot, rewrite
    from ulysses_compile.core.options import Options

    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph

    def backend(gm, example_inputs):
        _, report = rewrite(gm, example_inputs, Options.parse({"compiler": "aot_eager"}), dist.group.WORLD)
        graphs.append(gm)
        return aot(keep, keep, not report.rank_specific)(gm, example_inputs)

    recompiled = torch.compile(parallelized._orig_mod, backend=backend)
    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called"):
        getattr(recompiled, hooks).update(getattr(parallelized, hooks))
    backward_of(recompiled(**kwargs)).backward()
    return tuple(graphs)


def sent_to_heads(gm) -> list[tuple]:
    """(the value sent, the value received) for each tensor an all-to-all turns from sequence- to
    head-sharded, in graph order: a ``seq_to_heads`` call's input and result, and each of a
    ``seq_to_heads_qkv`` call's query, key and value (one all-to-all for the three) with its item of the
    call's result."""
    from ulysses_compile.core.collectives import seq_to_heads, seq_to_heads_qkv

    pairs = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is seq_to_heads:
            pairs.append((node.args[0].meta["val"], node.meta["val"]))
        elif node.op == "call_function" and node.target is seq_to_heads_qkv:
            sent = (node.args[0], node.kwargs["key"], node.kwargs["value"])
            assert isinstance(node.meta["val"], tuple) and len(node.meta["val"]) == 3, node.meta["val"]
            pairs += [(item.meta["val"], received) for item, received in zip(sent, node.meta["val"])]
    return pairs
