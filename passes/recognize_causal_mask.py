"""Turn a causal mask the model builds from positions alone into SDPA's ``is_causal=True``.

transformers builds a boolean ``[B, 1, S, S]`` mask even when it is plain causal (its ``sdpa_mask``
from aranges). Left as it is, every rank would build and keep the S x S mask (memory that does not
shrink with P), and SDPA with an explicit mask runs its slower masked kernel.

Before::

    arange = torch.arange(16); ...; le = getitem_6 <= getitem_5; ...      # no graph input involved
    attention_mask = result_2.expand(2, -1, 16, 16)
    attn = scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, scale=0.35)

After (the mask's nodes are dead and removed)::

    attn = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=0.35, is_causal=True)

Only a boolean mask that depends on no graph input (no ids, no padding mask, no symbolic size, no
buffer) is considered: the pass computes it once and rewrites only if every [query, key] slice equals
the lower triangle, so the result is exactly the model's. A mask built from an ``attention_mask`` or
``position_ids`` the user passes is kept (its values can change between calls).

Pinned on a small model: ``tests/test_pass_goldens.py::test_recognize_causal_mask``.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ulysses_compile.passes.detect_attention import SDPA_PARAMS, SDPA_TARGETS, sdpa_arguments
from ulysses_compile.report import module_path

log = logging.getLogger("ulysses_compile")


def recognize_causal_mask(gm: fx.GraphModule, ctx) -> None:
    verdicts: dict[fx.Node, bool] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        arguments = sdpa_arguments(node)
        mask = arguments.get("attn_mask")
        if not isinstance(mask, fx.Node) or arguments.get("is_causal", False):
            continue
        if mask not in verdicts:
            verdicts[mask] = _is_causal(mask, arguments["query"], arguments["key"])
        if verdicts[mask]:
            _set_argument(node, "attn_mask", None)
            _set_argument(node, "is_causal", True)
            log.info("ulysses_compile: %s: its mask is the causal triangle, built from positions alone; "
                     "it becomes is_causal=True", module_path(node) or node.name)
    for mask, causal in verdicts.items():
        if causal:
            _erase_unused(mask)


def _set_argument(node: fx.Node, name: str, value) -> None:
    index = SDPA_PARAMS.index(name)
    if index < len(node.args):
        node.args = (*node.args[:index], value, *node.args[index + 1 :])
    else:
        node.kwargs = {**node.kwargs, name: value}


def _erase_unused(node: fx.Node) -> None:
    """``node`` and what only it used: the mask's own nodes (all pure: they were computed above)."""
    if node.users or node.op == "placeholder":
        return
    inputs = node.all_input_nodes
    node.graph.erase_node(node)
    for source in inputs:
        _erase_unused(source)


def _is_causal(mask: fx.Node, query: fx.Node, key: fx.Node) -> bool:
    value = mask.meta.get("example_value")
    queries, keys = (node.meta["example_value"].shape[-2] for node in (query, key))
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() >= 2
            and isinstance(queries, int) and queries == keys and tuple(value.shape[-2:]) == (queries, keys)):
        return False
    computed = _compute(mask)
    if computed is None:
        return False
    triangle = torch.ones(queries, keys, dtype=torch.bool, device=computed.device).tril()
    return bool((computed == triangle).all())


def _compute(mask: fx.Node) -> torch.Tensor | None:
    """The mask's value, from the nodes it depends on; None when one of them is a graph input."""
    needed, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op != "call_function" and node.op != "call_method":
            return None
        needed.add(node)
        stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in mask.graph.nodes:
        if node in needed:
            copies[node] = graph.node_copy(node, lambda n: copies[n])
    graph.output(copies[mask])
    with torch.no_grad():
        return fx.GraphModule(torch.nn.Module(), graph)()
