"""Turn each node's global computation into its local one, as its sharding rule prescribed.

Before (global sizes, as Dynamo traced them; h is S(1))::

    q = h.view((2, 16, -1, 16))
    m = x.mean(1)                                    # over the sharded sequence
    loss = F.cross_entropy(logits, labels, reduction="mean")

After (P = 2)::

    q = h.view((2, 8, 4, 16))
    m_1 = x.sum(1)                                   # Partial
    m = m_1 / 16                                     # Partial: the ranks' terms sum to the mean
    loss_1 = F.cross_entropy(logits, labels, reduction="sum")   # Partial
    counted_tokens = counted_tokens(labels, -100, None)          # Partial
    loss = loss_1 / counted_tokens                   # wants both whole: redistribute reduces them

It inserts no collective: a node it adds states its placement, and redistribute, which runs next,
inserts what turns one placement into another. The node that held the global result keeps its name
and its users.

Pinned on a small model: ``tests/test_pass_goldens.py::test_localize_ops``.
"""

from __future__ import annotations

import torch.fx as fx

from ulysses_compile.core.sharding import sharding_of


def localize_ops(gm: fx.GraphModule, ctx) -> None:
    for node in list(gm.graph.nodes):
        sharding = sharding_of(node)
        if sharding is not None and sharding.localize is not None:
            sharding.localize(node, sharding, ctx)
