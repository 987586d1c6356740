"""A ``permute`` that makes k^T from another layout in one step (GPT-1 writes
``x.view(B, S, H, D).permute(0, 2, 3, 1)`` for ``[B, H, D, S]``) becomes a permute to ``[B, H, S, D]`` and a
transpose of the last two dims, so that detect_attention finds the key as it finds ``k.transpose(-2, -1)``.

Before (the second operand of ``q @ k^T``; ``x_1`` is k as ``[B, S, H, D]``)::

    k_1 = x_1.permute(0, 2, 3, 1)                # [B, H, D, S]
    matmul = torch.matmul(q_1, k_1)

After::

    permute_4 = x_1.permute(0, 2, 1, 3)          # k: [B, H, S, D]
    transpose = permute_4.transpose(-2, -1)
    matmul = torch.matmul(q_1, transpose)

The same views of the same values: only the graph's spelling changes. Only permutes read as the second
operand of a product (``matmul``, ``@``, ``bmm``, ``baddbmm``) that bring their input's last dim (the head
dim, which the product contracts) second to last, and not one that swaps the last two dims alone
(already read as k^T).

Pinned on a small model: ``tests/test_pass_goldens.py::test_split_key_permutes``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import fill_example_values, permute_dims
from ulysses_compile.core.ops import spellings

PRODUCTS = (*spellings("matmul", "bmm"), operator.matmul)
BIASED_PRODUCTS = spellings("baddbmm")
PERMUTES = spellings("permute")


def split_key_permutes(gm: fx.GraphModule, ctx) -> None:
    for node in list(gm.graph.nodes):
        second = _second_operand(node)
        if second is None or second.op not in ("call_function", "call_method") or second.target not in PERMUTES:
            continue
        dims = _dims(second)
        # k^T contracts k's last dim (its head dim): it comes second to last
        if dims is None or dims[-2] != len(dims) - 1:
            continue
        first = [*dims[:-2], dims[-1], dims[-2]]
        if first == sorted(first):  # a transpose of the last two dims alone: k^T as it is read
            continue
        with gm.graph.inserting_before(node):
            key = gm.graph.call_method("permute", (second.args[0], *first))
            transposed = gm.graph.call_method("transpose", (key, -2, -1))
        fill_example_values([key, transposed], second)
        node.replace_input_with(second, transposed)
        if not second.users:
            gm.graph.erase_node(second)
    gm.graph.lint()


def _second_operand(node: fx.Node) -> fx.Node | None:
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        if node.target in PRODUCTS:
            operand = node.args[1] if len(node.args) > 1 else None
        elif node.target in BIASED_PRODUCTS:
            operand = node.args[2] if len(node.args) > 2 else node.kwargs.get("batch2")
        else:
            return None
    except TypeError:  # an unhashable target
        return None
    return operand if isinstance(operand, fx.Node) else None


def _dims(permute: fx.Node) -> list[int] | None:
    source = permute.args[0] if permute.args else None
    value = source.meta.get("example_value") if isinstance(source, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() < 3:
        return None
    dims = permute_dims(permute)
    if len(dims) != value.dim() or not all(isinstance(d, int) for d in dims):
        return None
    return [d % value.dim() for d in dims]
