"""Compute a gated MLP (Llama's, Mistral's, Qwen's) in chunks of rows, so neither its forward nor its
backward holds a ``[S/P, intermediate]`` value whole, and the backward keeps only the MLP's input.

Before (redistribute's local graph)::

    linear_4 = torch._C._nn.linear(hidden_states_6, sync_grad_7, None)
    silu = torch.nn.functional.silu(linear_4)
    linear_5 = torch._C._nn.linear(hidden_states_6, sync_grad_8, None)
    mul_11 = silu * linear_5
    down_proj = torch._C._nn.linear(mul_11, sync_grad_9, None)

After::

    tiled_gated_mlp = ulysses_compile_core_runtime_tiled_gated_mlp(hidden_states_6, sync_grad_7, sync_grad_8,
                                                              sync_grad_9, 'silu')

``tiled_gated_mlp`` (``ulysses_compile/core/runtime.py``) runs eager's kernels on chunks of as many rows as
the MLP is wide (ALST's ``TiledMLP`` cut, written there by hand); its backward recomputes each chunk's
gate and up projections. Eager saves four ``[S/P, intermediate]`` values per layer for the backward (or,
in a checkpointed layer, makes them again in the backward), three to four times the MLP's input each
for common widths: the tiled MLP saves the input alone and its transients are one chunk's. Outputs and
input gradients are eager's bit for bit per row; the weights' gradients are sums over chunks, in fp32.

By default (option ``tile_mlp="checkpointed"``) only MLPs in checkpointed regions are tiled: there the
backward makes the intermediates again anyway, and the tiled MLP's backward needs its input alone, so
its forward is not re-run unless a later op needs its output (the final norm needs the last layer's):
11 matmuls a step instead of 12. Elsewhere tiling trades memory for time
(two more matmuls in the backward, 11 instead of 9); ``tile_mlp=True`` tiles every gated MLP,
``False`` none.

Left as it is: an MLP whose intermediate values have other uses, biases, activations other than SiLU
and GELU, mixed dtypes (autocast), and an input sharded on its last dim.

Pinned on a small model: ``tests/test_pass_goldens.py::test_tile_mlp``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ulysses_compile.core.compat import recompute_region
from ulysses_compile.core.fx_graph import insert_part
from ulysses_compile.core.ops import spellings
from ulysses_compile.core.runtime import tiled_gated_mlp
from ulysses_compile.core.sharding import NodeSharding, Shard, place, sharding_of

_LINEARS = spellings("linear")
_ACTIVATIONS = {function: name for name in ("silu", "gelu") for function in spellings(name)}


def tile_mlp(gm: fx.GraphModule, ctx) -> list[str]:
    """Returns a note per MLP tiled."""
    notes = []
    if ctx.options.tile_mlp is False:
        return notes
    for down in list(gm.graph.nodes):
        matched = _gated_mlp(down)
        if matched is None or (ctx.options.tile_mlp == "checkpointed" and recompute_region(down) is None):
            continue
        x, weights, activation, intermediates = matched
        mlp = insert_part(down, "call_function", tiled_gated_mlp, (x, *weights, activation))
        place(mlp, NodeSharding(sharding_of(down).output, sharding_of(down).global_value))
        down.replace_all_uses_with(mlp)
        for node in (down, *intermediates):
            gm.graph.erase_node(node)
        width = sharding_of(weights[0]).global_value.shape[0]
        notes.append(f"{down.name}: the gated MLP ({activation}, intermediate {width}) runs in chunks of rows "
                     f"(runtime.tiled_gated_mlp): its [S/P, {width}] values are never whole, only its input is saved")
    return notes


def _linear(node, x=None) -> fx.Node | None:
    """The weight of a bias-free linear of ``x`` (of any input, if None)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _LINEARS \
            or len(node.args) < 2 or (x is not None and node.args[0] is not x):
        return None
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return None if bias is not None else node.args[1]


def _activation(node) -> str | None:
    """The name ``tiled_gated_mlp`` knows an activation call by, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _ACTIVATIONS \
            or len(node.args) != 1 or node.kwargs.get("inplace"):
        return None
    if _ACTIVATIONS[node.target] == "silu":
        return "silu"
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(node.kwargs.get("approximate", "none"))


def _gated_mlp(down: fx.Node):
    """(x, (gate, up, down) weights, activation name, the nodes it replaces) when ``down`` is the
    output of ``linear(act(linear(x, gate)) * linear(x, up), down)`` whose parts have no other use."""
    down_weight = _linear(down)
    product = down.args[0] if down_weight is not None else None
    if not isinstance(product, fx.Node) or product.target is not operator.mul or len(product.users) != 1 \
            or len(product.args) != 2:
        return None
    for activated, up in (product.args, product.args[::-1]):
        activation = _activation(activated)
        if activation is None or not isinstance(up, fx.Node):
            continue
        gate = activated.args[0]
        gate_weight = _linear(gate)
        x = gate.args[0] if gate_weight is not None else None
        up_weight = _linear(up, x) if x is not None else None
        if up_weight is None or any(len(node.users) != 1 for node in (gate, activated, up)):
            continue
        weights = (gate_weight, up_weight, down_weight)
        if not _tileable(x, weights, down):
            continue
        return x, weights, activation, (product, activated, gate, up)
    return None


def _tileable(x: fx.Node, weights: tuple, down: fx.Node) -> bool:
    """One dtype throughout, 2-d weights, and rows that are whole in their last dim."""
    values = [sharding_of(node) for node in (x, *weights, down)]
    if any(value is None or not isinstance(value.global_value, torch.Tensor) for value in values):
        return False
    dtypes = {value.global_value.dtype for value in values}
    placement = values[0].output
    last = values[0].global_value.dim() - 1
    return len(dtypes) == 1 and dtypes.pop().is_floating_point and all(
        value.global_value.dim() == 2 for value in values[1:4]) and (
        not isinstance(placement, Shard) or placement.dim != last) and placement == values[-1].output
