"""A convolution along the sequence in which each position sees only itself and the positions before it
(the short causal convolutions of hybrid models: Mamba's, Mamba 2's, LFM2's) becomes one call,
``causal_conv1d``, which the rules run on each rank's block with the few rows before it
(``rows_before``), where the convolution and the slice that keeps its first outputs could only run on
the gathered sequence.

Before (``nn.Conv1d(C, C, k, groups=C, padding=k - 1)`` then ``[..., :S]``, as transformers writes it)::

    conv1d = torch.conv1d(x, weight, bias, (1,), (3,), (1,), 64)     # x: [B, C, S] -> [B, C, S + 3]
    y = conv1d[(Ellipsis, slice(None, 24, None))]                     # [B, C, S]

After::

    y = ulysses_compile_core_runtime_causal_conv1d(x, weight, bias, dilation = 1, groups = 64)

Only a stride of 1 and a padding of ``dilation * (k - 1)`` on both sides whose only reader keeps the
first S outputs (S the input's length) are causal; any other convolution is left as it is.

Pinned on a small model: ``tests/test_pass_goldens.py::test_recognize_causal_convolution``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import index_entries, insert_part, method_or_function_args
from ulysses_compile.core.ops import spellings
from ulysses_compile.core.runtime import causal_conv1d
from ulysses_compile.core.sizes import same_size


def recognize_causal_convolution(gm: fx.GraphModule, ctx) -> list[str]:
    """Rewrite each causal convolution; returns the names of the convolutions rewritten."""
    rewritten = []
    for node in list(gm.graph.nodes):
        found = _causal(node)
        if found is None:
            continue
        kept, dilation, groups = found
        args = method_or_function_args(node, ("input", "weight", "bias"))
        call = insert_part(kept, "call_function", causal_conv1d, (args["input"], args["weight"], args.get("bias")),
                           {"dilation": dilation, "groups": groups})
        call.meta["example_value"] = kept.meta["example_value"]
        kept.replace_all_uses_with(call)
        gm.graph.erase_node(kept)
        gm.graph.erase_node(node)
        rewritten.append(node.name)
    return rewritten


def causal_convolutions(graph: fx.Graph) -> list[fx.Node]:
    """The ``causal_conv1d`` calls of a graph this pass rewrote."""
    return list(graph.find_nodes(op="call_function", target=causal_conv1d))


def _causal(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(the slice keeping the first outputs, dilation, groups) of a causal ``conv1d``, or None."""
    if node.op != "call_function" or node.target not in spellings("conv1d") or len(node.users) != 1:
        return None
    args = method_or_function_args(node, ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
                                   {"stride": 1, "padding": 0, "dilation": 1, "groups": 1})
    x, weight = args["input"].meta.get("example_value"), args["weight"].meta.get("example_value")
    stride, padding, dilation = (_single(args[name]) for name in ("stride", "padding", "dilation"))
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not isinstance(weight, torch.Tensor) \
            or None in (stride, padding, dilation) or stride != 1 or padding != dilation * (weight.shape[-1] - 1) \
            or not isinstance(args["groups"], int):
        return None
    (kept,) = node.users
    if kept.op != "call_function" or kept.target is not operator.getitem or kept.args[0] is not node:
        return None
    entries = index_entries(kept.args[1], 3)
    if len(entries) != 3 or entries[:2] != [slice(None), slice(None)] or not isinstance(entries[2], slice) \
            or entries[2].start not in (None, 0) or entries[2].step not in (None, 1):
        return None
    stop = entries[2].stop  # a symbolic length's stop is a node of the graph
    stop = stop.meta.get("example_value") if isinstance(stop, fx.Node) else stop
    if stop is None or not same_size(stop, x.shape[-1]):
        return None
    return kept, dilation, args["groups"]


def _single(value) -> int | None:
    """A convolution's 1-d setting given as an int or a one-element tuple; None for any other (a string
    padding such as ``"same"``)."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, int) else None
