"""Turn each node's global computation into its local one, as its sharding rule prescribed.

Before (global sizes, as Dynamo traced them; h is S(1))::

    q = h.view((2, 16, -1, 16))
    m = x.mean(1)                                    # over the sharded sequence
    loss = F.cross_entropy(logits, labels, reduction="mean")

After (P = 2)::

    q = h.view((2, 8, 4, 16))
    m = x.mean(1) / 2                                # Partial: the ranks' terms sum to the mean
    loss = reduce_partial(F.cross_entropy(logits, labels, reduction="sum"), group)
           / reduce_partial(counted_tokens(labels, -100, None), group)

Pinned on a small model: ``tests/test_pass_goldens.py::test_localize_ops``.
"""

from __future__ import annotations

import torch.fx as fx

from ulysses_compile.sharding import sharding_of


def localize_ops(gm: fx.GraphModule, ctx) -> None:
    for node in list(gm.graph.nodes):
        sharding = sharding_of(node)
        if sharding is not None and sharding.localize is not None:
            sharding.localize(node, sharding, ctx)
