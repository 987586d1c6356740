"""Inductor's post-grad pass for ZeRO's parameter all-gathers: merge each layer's gathers into one and
issue each layer's before the previous layer's wait (prefetch), as FSDP does.

Before (a post-grad program; each gather tagged with its layer by ``tag_zero_gather``)::

    ag_0 = all_gather_into_tensor(w_q_shard, 2, "0")     # layer h.0
    w_q = wait_tensor(ag_0)
    ag_1 = all_gather_into_tensor(w_k_shard, 2, "0")     # layer h.0
    w_k = wait_tensor(ag_1)
    ag_2 = all_gather_into_tensor(w_q1_shard, 2, "0")    # layer h.1
    w_q1 = wait_tensor(ag_2)

After::

    ag = all_gather_into_tensor(cat(w_q_shard, w_k_shard), 2, "0")   # layer h.0: one bucket
    ag_2 = all_gather_into_tensor(w_q1_shard, 2, "0")                # layer h.1, issued ahead
    w_q, w_k = split(wait_tensor(ag))
    w_q1 = wait_tensor(ag_2)

Pinned on a small program: ``tests/test_pass_goldens.py::test_bucket_zero_gathers``.
"""

from __future__ import annotations

import itertools

from ulysses_compile.core import fx_graph
from ulysses_compile.core.compat import (
    CustomGraphPass,
    OrderedSet,
    bucket_all_gather_by_mb,
    bucket_all_reduce_by_mb,
    bucket_cap_mb_by_bucket_idx_default,
    bucket_reduce_scatter_by_mb,
    get_hash_for_files,
    is_all_gather_into_tensor,
    is_wait_tensor,
    merge_all_gather,
    preserve_node_ordering,
)
from ulysses_compile.core.fx_graph import ancestors

ZERO_GATHER = "ulysses_zero_gather"


def tag_zero_gather(node, unit: str) -> None:
    """Mark a node as ZeRO's gather of a parameter of ``unit`` (a layer); AOTAutograd copies
    ``meta["custom"]`` to every node it traces from it, so Inductor's post-grad graph still tells the
    parameter's all-gather apart, and whose it is."""
    node.meta["custom"] = {**node.meta.get("custom", {}), ZERO_GATHER: unit}


def zero_unit(node) -> str | None:
    """The unit ``tag_zero_gather`` gave a node, None if it is not ZeRO's gather."""
    return node.meta.get("custom", {}).get(ZERO_GATHER)


class BucketZeroGathers(CustomGraphPass):
    """The pass, as Inductor's ``post_grad_custom_post_pass``."""

    def __call__(self, graph) -> None:
        if buckets := zero_gather_buckets(graph):
            merge_all_gather(graph.owning_module, buckets)
        _prefetch_zero_gathers(graph)

    def uuid(self):
        return get_hash_for_files((__file__, fx_graph.__file__))


def zero_gather_buckets(graph) -> list[list]:
    """The all-gathers of each unit's parameters (``tag_zero_gather``) that follow one another among
    ZeRO's gathers, each run of two or more a bucket to merge into one. torch's bucketing finds the runs
    it may merge (same group and dtype, none depending on another), given a filter by the tag and no
    size cap; each run is then cut where the unit changes. (torch's own "only_fsdp" filter is
    structural, and could classify a gather differently on ranks whose graphs differ; the tag is the
    same on every rank.)"""
    runs = bucket_all_gather_by_mb(graph.owning_module, lambda index: float(2**40),
                                   filter_wait_node=lambda wait: zero_unit(wait.args[0]) is not None)
    return [bucket for run in runs for _, same_unit in itertools.groupby(run, key=zero_unit)
            if len(bucket := list(same_unit)) > 1]


def inductor_buckets(gm, reduce_scatter_mib: float) -> list[list]:
    """The collectives of an AOTAutograd program that Inductor merges under ``backend.bucketing``'s
    settings, each bucket a list of two or more: ZeRO's all-gathers one per unit
    (``zero_gather_buckets``), reduce-scatters up to ``reduce_scatter_mib``, all-reduces up to torch's
    default cap. Read, not applied."""
    return [*zero_gather_buckets(gm.graph), *bucket_reduce_scatter_by_mb(gm, lambda index: reduce_scatter_mib),
            *bucket_all_reduce_by_mb(gm, bucket_cap_mb_by_bucket_idx_default)]


def _prefetch_zero_gathers(graph) -> None:
    """Issue each ZeRO all-gather (a unit's bucket, in graph order) before the previous one's wait, so
    the parameters of the next layer arrive while this one computes, as FSDP prefetches one module ahead
    (at stage 3, two units' parameters are then whole at once in graph order). The start moves with
    what it reads after that wait (the shard's cast and copy into the bucket); control dependencies
    (torch's ``preserve_node_ordering``) pin start i < start i+1 < wait i, so Inductor's memory-driven
    reordering cannot undo the prefetch and every rank issues the gathers in the same order among
    themselves. (Their order against other collectives is graph order only as far as Inductor keeps it:
    the reduce-scatters and all-reduces are bucketed after this pass, and pinning them here would stop
    that.)"""
    starts = [node for node in graph.nodes if is_all_gather_into_tensor(node) and zero_unit(node) is not None]
    order = {}
    for start, following in zip(starts, starts[1:]):
        wait = next((user for user in start.users if is_wait_tensor(user)), None)
        reads = ancestors([following])
        if wait is None or wait in reads:
            continue
        position = {node: index for index, node in enumerate(graph.nodes)}
        for node in sorted((node for node in reads if position[node] > position[wait]), key=position.get):
            wait.prepend(node)
        order.setdefault(wait, OrderedSet()).add(following)
        order.setdefault(following, OrderedSet()).add(start)
    preserve_node_ordering(graph, order)
