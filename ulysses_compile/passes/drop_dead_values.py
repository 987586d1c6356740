"""Drop the values nothing reads before anything is placed: a dead value placed sequence-sharded or
whole would still cost the collective that makes it so, and Inductor removes the value only after.

Dynamo keeps values the model computed and threw away: transformers builds a sliding-window mask and
its packed-sequence check from the position ids, then passes ``None`` to SDPA when the window covers
the sequence. Placed, the check's ``diff`` of the sharded positions gathered them on every call.

Before::

    position_ids = arange + 0
    position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
    packed_sequence_mask = (position_diff != 1).cumsum(-1)
    attention_mask = result_2.expand(2, -1, 24, 24)      # read by nothing
    attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)

After: the mask and everything only it read are gone; ``position_ids`` stays (RoPE reads it).

Only ops known to compute a fresh value and nothing else are dropped: elementwise ops (the op table's),
views, shape ops, comparisons and the tensor factories that build masks and positions. Anything else
unread stays (a write in place, a random draw, ``F.batch_norm`` updating its running statistics,
``torch.func.grad`` marking an input as requiring grad, a higher-order op).

Pinned on a small model: ``tests/test_pass_goldens.py::test_drop_dead_values``.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import mutated_arg
from ulysses_compile.core.ops import elementwise_targets, spellings
from ulysses_compile.core.random_draws import random_draw


def drop_dead_values(gm: fx.GraphModule, ctx) -> list[str]:
    """Erase every unread pure tensor value, last first (so what only it read follows); returns the
    names erased."""
    erased = []
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and _pure_tensor_value(node):
            erased.append(node.name)
            gm.graph.erase_node(node)
    return erased[::-1]


def _pure_tensor_value(node: fx.Node) -> bool:
    return (node.op in ("call_function", "call_method") and isinstance(node.meta.get("example_value"), torch.Tensor)
            and node.target in _pure_targets() and mutated_arg(node) is None and random_draw(node) is None
            and not (isinstance(node.target, str) and node.target.endswith("_")))  # (x.requires_grad_())


@functools.cache
def _pure_targets() -> frozenset:
    shapes = spellings("view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "transpose", "permute",
                       "flatten", "unflatten", "narrow", "select", "diff", "cumsum", "arange", "full", "full_like",
                       "zeros", "zeros_like", "ones", "ones_like", "new_ones", "new_zeros", "new_full", "tril",
                       "triu", "cat", "stack", "any", "all", "sum")
    return elementwise_targets() | {*shapes, operator.getitem}
