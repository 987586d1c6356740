"""Return the graph input an LM head's weight is made from, not the weight, for logits a tiled loss
left out of the graph (``tile_token_loss``), and say how the weight is made from it.

Before (after the gradient passes; under ZeRO-3 the chain is ``gather_parameter(shard, ...)``)::

    sync_grad_1 = ulysses_compile_core_collectives_sync_grad(l_lm_head_weight, group_name = '0')
    token_loss_sum = ulysses_compile_core_runtime_token_loss_sum(None, rows, sync_grad_1, target, -100)
    return (loss, hidden, sync_grad_1)             # output 1: linear(hidden, output 2) when read

After::

    return (loss, hidden, l_lm_head_weight)        # output 1: linear(hidden, sync_grad(output 2)) when read

An output that requires grad gets a gradient in the graph's backward, and AOTAutograd makes it a
``[V, H]`` tensor of zeros whenever nobody reads the logits (a step that trains on ``.loss``), then runs
the weight's reductions on it: ``sync_grad``'s all-reduce, or ZeRO's reduce-scatter. Under ZeRO-3 the
gathered weight would also stay alive while the logits may be read. An input returned as it is has no
gradient in the graph: the caller replays the chain (``boundary.WeightChain``) when the logits are read,
a ZeRO gather then, and their gradient goes through the chain's own backward. Left as it is: a weight
not made from one input by ops of that input alone, and one made with collectives over other ranks than
the sequence group (a data-parallel average, ZeRO over a ``("dp", "sp")`` mesh): reading the logits, or
a gradient through them, would then be a collective of ranks that need not read alike.

Pinned on a small model: ``tests/test_pass_goldens.py::test_return_weight_inputs``.
"""

from __future__ import annotations

import inspect

import torch.fx as fx

from ulysses_compile.core.boundary import LazyLinear, WeightChain
from ulysses_compile.core.compat import tree_leaves
from ulysses_compile.core.sharding import sharding_of


def return_weight_inputs(gm: fx.GraphModule, ctx, computed: dict[int, int]) -> dict[int, LazyLinear]:
    """``computed``: output position of each left-out logits -> position of its weight."""
    (output,) = gm.graph.find_nodes(op="output")
    values = list(output.args[0])
    found = {}
    for position, weight in computed.items():
        vocab = sharding_of(values[weight]).global_value.shape[0]
        source, steps = _chain(values[weight])
        if source is None or any(_group(step) not in (None, ctx.group_name) for step in steps):
            found[position] = LazyLinear(weight, vocab)
            continue
        values[weight] = source
        found[position] = LazyLinear(weight, vocab, WeightChain(steps))
    output.args = (type(output.args[0])(values),)
    return found


def _chain(node: fx.Node) -> tuple[fx.Node | None, tuple]:
    """The placeholder ``node`` is made from by ops whose other arguments are constants, and those ops in
    the order they run; (None, ()) if there is no such placeholder."""
    steps = []
    while node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
        if any(isinstance(value, fx.Node) for value in tree_leaves((node.args[1:], node.kwargs))):
            return None, ()
        steps.append((node.op, node.target, tuple(node.args[1:]), tuple(node.kwargs.items())))
        node = node.args[0]
    if node.op != "placeholder":
        return None, ()
    return node, tuple(reversed(steps))


def _group(step: tuple) -> str | None:
    """The process group a chain step's collective runs over, None for an op that is not one."""
    op, target, args, kwargs = step
    if op != "call_function":
        return None
    try:
        return inspect.signature(target).bind(None, *args, **dict(kwargs)).arguments.get("group_name")
    except (TypeError, ValueError):  # a builtin without a signature, or not bound so
        return None
