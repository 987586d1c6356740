"""With a data x sequence mesh, average every parameter's gradient over the data-parallel replicas.

Before (a parameter placeholder and its uses)::

    linear = torch._C._nn.linear(x, sync_grad(l_weight, group_name='sp'))

After (D replicas on the mesh's "dp" dim)::

    l_weight_avg = average_grad(l_weight, group_name='dp', group_size=D)
    linear = torch._C._nn.linear(x, sync_grad(l_weight_avg, group_name='sp'))

Each replica runs on its own batch; inside a replica the sequence-parallel ranks share one batch and sum
their gradient shares (``sync_grad``), across replicas gradients are averaged, as DistributedDataParallel
does. Frozen parameters, buffers and ZeRO's shards are left alone.

Pinned on a small model: ``tests/test_pass_goldens.py::test_average_data_parallel_grads``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ulysses_compile.core.collectives import average_grad, gather_parameter, insert_call
from ulysses_compile.core.sharding import REPLICATE, NodeSharding, place


def average_data_parallel_grads(gm: fx.GraphModule, ctx) -> None:
    if ctx.data_parallel is None:
        return
    group_name, group_size = ctx.data_parallel
    for node in list(gm.graph.nodes):  # graph order: every rank must issue the all-reduces in one order
        value = node.meta.get("example_value")
        if node not in ctx.parameters or not isinstance(value, torch.Tensor) or not value.requires_grad \
                or not node.users or all(user.target is gather_parameter for user in node.users):
            continue  # a ZeRO shard's gradient is reduced over every rank by its gather's backward
        averaged = place(insert_call(gm.graph, average_grad, (node, group_name, group_size), after=node),
                         NodeSharding(REPLICATE, value))
        node.replace_all_uses_with(averaged, delete_user_cb=lambda user: user is not averaged)
