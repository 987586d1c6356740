"""Under ZeRO with sequence parallelism, one gradient collective per parameter instead of two.

Before (P sequence ranks, N = D x P ranks holding shards)::

    weight = gather_parameter(shard, shape=(64, 64), group_name='0', group_size=4)
    sync_grad = sync_grad(weight, group_name='1')
    linear = torch._C._nn.linear(x, sync_grad)

After::

    weight = gather_parameter(shard, shape=(64, 64), group_name='0', group_size=4, grad_divisor=2)
    linear = torch._C._nn.linear(x, weight)

The backward before: an all-reduce over the sequence ranks sums their shares of the gradient, then the
gather's reduce-scatter over all N ranks sums P equal copies of each replica's gradient and divides by
N. After: the reduce-scatter sums the shares themselves and divides by D (the replicas), the same shard
of the same average for half the gradient traffic and one meeting of the ranks fewer (the shares are
now summed in the gather's ``reduce_dtype``, where ``sync_grad`` summed them in the parameter's dtype).
Only where every
use of the gathered parameter goes through ``sync_grad`` over the sequence group: a use whose gradient
is already whole on each rank must not be summed P times. ZeRO shards over every rank of the group or
mesh (ulysses_compile/zero.py), so the sequence ranks are among the gather's.

Pinned on a small model: ``tests/test_pass_goldens.py::test_merge_gradient_reductions``.
"""

from __future__ import annotations

import inspect

import torch.fx as fx

from ulysses_compile.core.collectives import gather_parameter, sync_grad
from ulysses_compile.core.errors import InternalError

_GATHER = inspect.signature(gather_parameter)
_SYNC = inspect.signature(sync_grad)


def merge_gradient_reductions(gm: fx.GraphModule, ctx) -> None:
    for gather in gm.graph.find_nodes(op="call_function", target=gather_parameter):
        syncs = list(gather.users)
        if not syncs or not all(user.target is sync_grad and _group(user) == ctx.group_name for user in syncs):
            continue
        group_size = _GATHER.bind(*gather.args, **gather.kwargs).arguments["group_size"]
        if group_size % ctx.world_size:
            raise InternalError(f"{gather.name}: ZeRO's group of {group_size} ranks does not hold the "
                                f"{ctx.world_size} sequence ranks whole")
        gather.update_kwarg("grad_divisor", group_size // ctx.world_size)
        for sync in syncs:
            sync.replace_all_uses_with(gather)
            gm.graph.erase_node(sync)


def _group(sync: fx.Node) -> str:
    return _SYNC.bind(*sync.args, **sync.kwargs).arguments["group_name"]
