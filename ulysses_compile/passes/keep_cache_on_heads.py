"""Keys and values a graph returns for a KV cache leave it on the heads its attention ran on, so the
graph that decodes over them reads the rank's heads of the cache where they lie.

Before (Ulysses; transformers' ``DynamicCache`` makes the keys and values the attention reads outputs of
the prompt's graph)::

    seq_to_heads_qkv = seq_to_heads_qkv(q, key = k, value = v, seq_dim = 2, head_dim = 1, ...)
    getitem_4 = seq_to_heads_qkv[1]
    getitem_5 = seq_to_heads_qkv[2]
    ...
    return (linear_1, k, v)                  # k, v: the rank's block of the sequence, [B, Hkv, S/P, D]

After::

    return (linear_1, getitem_4, getitem_5)  # the rank's key/value heads, every position: [B, Hkv/P, S, D]

The caller reads them as eager's tensors (``boundary.GatheredOnUse``, gathered over the heads when read),
and a graph with fewer new positions than ranks that attends over them (``detect_attention``:
``on_cache_heads``) computes its attention on the rank's heads of the cache, with no all-to-all: the
key/value cache of each rank holds 1/P of it, as in the prompt's graph. Only outputs left lazily
(``outputs="lazy"``, the default) of attention under Ulysses alone (no ring), whose key/value heads split
like the query heads (else the cache stays in sequence blocks, and decoding reads it whole), and not
written in place after the all-to-all.

Pinned on a small model: ``tests/test_pass_goldens.py::test_keep_cache_on_heads``.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from ulysses_compile.core.boundary import SequenceBlocks
from ulysses_compile.core.collectives import seq_to_heads, seq_to_heads_qkv
from ulysses_compile.core.sharding import Shard, placed_as, sharding_of
from ulysses_compile.passes.in_place_writes import alias_bases, written_bases


def keep_cache_on_heads(gm: fx.GraphModule, ctx, sites: list, sharded: dict[int, SequenceBlocks]) \
        -> dict[int, SequenceBlocks]:
    """The graph's outputs that leave sharded (position -> blocks), with the keys and values of the
    sites returned on the rank's heads."""
    if ctx.options.outputs != "lazy":
        return sharded
    on_heads = {}
    for site in sites:
        if site.ring == 1 and not site.on_cache_heads and site.kv_by_all_to_all(ctx.world_size):
            on_heads.update(_heads_of(gm.graph, site.head_axis))
    bases = alias_bases(gm.graph)
    written = written_bases(gm.graph, bases)
    output = gm.graph.output_node()
    values = output.args[0]  # Dynamo's graphs return a flat tuple
    flat = list(values) if isinstance(values, (tuple, list)) else [values]
    kept = dict(sharded)
    for position, value in enumerate(flat):
        # (a value written in place may have changed since the all-to-all read it)
        if position in sharded and value in on_heads and bases.get(value, value) not in written:
            flat[position] = local = on_heads[value]
            dim = sharding_of(local).output.dim
            kept[position] = SequenceBlocks(dim, 1, 1, sharding_of(local).global_value.shape[dim])
    output.args = (type(values)(flat) if isinstance(values, (tuple, list)) else flat[0],)
    return kept


def _heads_of(graph: fx.Graph, head_axis: int) -> dict[fx.Node, fx.Node]:
    """Each value an all-to-all sends to the rank's heads -> the rank's heads of it."""
    found = {}
    for node in graph.nodes:
        if node.op != "call_function" or not placed_as(node, Shard(head_axis)):
            continue
        if node.target is seq_to_heads:
            found[node.args[0]] = node
        elif node.target is operator.getitem and getattr(node.args[0], "target", None) is seq_to_heads_qkv:
            fused = node.args[0]
            sent = (fused.args[0], fused.kwargs["key"], fused.kwargs["value"])[node.args[1]]
            found[sent] = node
    return found
