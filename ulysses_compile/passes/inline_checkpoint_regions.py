"""Open up activation-checkpointed regions, so every later pass sees the attention inside them.

Dynamo captures ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (transformers'
``gradient_checkpointing_enable()``, torchtitan's and nanoGPT-style wrappers) as one higher-order op whose
body is a subgraph, opaque to the passes. This pass copies each body into the graph in place of the
call and tags the copied nodes ``recompute = PREFER_RECOMPUTE`` with one ``ac_graph_id`` per region:
the tags AOTAutograd itself puts on a region's ops when it traces the higher-order op, so its
partitioner keeps only the region's inputs and recomputes the rest in the backward, as checkpointing
would. What the region computes from parameters alone (ZeRO's gathers) is left untagged: stages 1
and 2 keep the gathered weights for the backward, stage 3 gathers them again (regather_parameters).
The region's outputs are tagged ``MUST_SAVE`` by ``recompute_inserted_nodes``: eager keeps them where
an op after the region needs them in its backward (the final norm after the last decoder layer), and
recomputing them would run the whole region again before that op's backward, holding its
intermediates alongside. (The partitioner saves a ``MUST_SAVE`` value only where the backward needs
it; on a view the tag has no effect, and the region is recomputed as before.)
Nodes later passes insert inside a region (the all-to-alls) get its tags from
``recompute_inserted_nodes``, so the backward recomputes them too, as DeepSpeed's checkpointing does.

Before (a Dynamo graph)::

    wrap_body_0 = self.wrap_body_0
    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, x, weight,
                                                                                 use_reentrant=False)
    y = tag_activation_checkpoint[0]

    # wrap_body_0: def forward(self, l_x_, l_weight_): linear = torch._C._nn.linear(l_x_, l_weight_); ...

After (golden: ``tests/test_checkpointing.py::test_checkpointed_region_is_inlined``)::

    linear = torch._C._nn.linear(x, weight)    # meta: recompute=PREFER_RECOMPUTE, ac_graph_id=1
    ...
    y = sdpa_out_projection                     # the body's output, in place of the getitem

A region checkpointed with a ``context_fn`` (selective checkpointing) keeps its policy out of reach of
the Dynamo graph: it is recomputed whole, and the report says so.

``recompute_inserted_nodes`` is pinned in ``tests/test_pass_goldens.py::test_recompute_inserted_nodes``.
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ulysses_compile.core.compat import checkpoint_context_fn, recompute_region, tag_recompute
from ulysses_compile.core.report import module_path

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def inline_checkpoint_regions(gm: fx.GraphModule, ctx) -> list[str]:
    """Inline every region; returns notes for the user (selective checkpointing recomputed whole)."""
    notes = []
    region_ids = itertools.count(1)
    for node in list(gm.graph.find_nodes(op="call_function", target=CHECKPOINT)):
        body = getattr(gm, node.args[0].target)
        if checkpoint_context_fn(body) is not None:
            paths = [module_path(inner) for inner in body.graph.nodes if module_path(inner)]
            where = min(paths, key=len, default=node.name)  # the checkpointed module: the outermost
            notes.append(f"{where}: selective checkpointing (context_fn) is recomputed whole under sequence "
                         f"parallelism")
        _inline(gm, node, body, next(region_ids), ctx.parameters)
    gm.delete_all_unused_submodules()
    return notes


def _inline(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule, region: int, parameters: set) -> None:
    graph = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    weights = set(parameters)  # parameters and what the region computes from them alone (ZeRO's gathers)
    operands = iter(call.args[1:])
    outputs = None
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(operands)
            elif node.op == "output":
                outputs = fx.node.map_arg(node.args[0], env.__getitem__)
            elif node.op == "get_attr":
                env[node] = _copy_attribute(gm, body, node)
            else:
                copied = graph.node_copy(node, env.__getitem__)
                if copied.all_input_nodes and set(copied.all_input_nodes) <= weights:
                    weights.add(copied)
                elif copied.target is not CHECKPOINT:
                    tag_recompute(copied, CheckpointPolicy.PREFER_RECOMPUTE, region)
                env[node] = copied
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    if call.users:
        call.replace_all_uses_with(outputs)  # a whole-tuple use
    body_attribute = call.args[0]
    graph.erase_node(call)
    if not body_attribute.users:
        graph.erase_node(body_attribute)
    for nested in [n for n in env.values() if isinstance(n, fx.Node) and n.target is CHECKPOINT]:
        _inline(gm, nested, getattr(gm, nested.args[0].target), region, weights)


def _copy_attribute(gm: fx.GraphModule, body: fx.GraphModule, node: fx.Node) -> fx.Node:
    """A body's attribute (a nested region's body, a constant) under a fresh name of ``gm``."""
    *path, leaf = node.target.split(".")
    value = getattr(body.get_submodule(".".join(path)), leaf)
    base = "_".join([*path, leaf])
    name = next(f"{base}_inlined_{index}" for index in itertools.count() if not hasattr(gm, f"{base}_inlined_{index}"))
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    copied = gm.graph.get_attr(name)
    copied.meta.update(node.meta)
    return copied


def recompute_inserted_nodes(gm: fx.GraphModule, ctx) -> None:
    """The last pass: tag a node the passes inserted inside a region as the region's own ops are tagged,
    where the tagged nodes it is computed from (through other untagged ones; graph inputs aside) and
    those that use it all belong to that one region; then tag the region's outputs (its nodes read
    outside it) ``MUST_SAVE``. Tagged here, last, the outputs are the final graph's: a nested region's
    output read only inside the outer one stays recomputed, and no node a later pass inserts in place
    of an output inherits the tag."""
    nodes = list(gm.graph.nodes)
    above: dict[fx.Node, set] = {}
    for node in nodes:
        above[node] = set().union(*(_regions(arg, above) for arg in node.all_input_nodes))
    below: dict[fx.Node, set] = {}
    for node in reversed(nodes):
        below[node] = set().union(*(_regions(user, below) for user in node.users))
    for node in nodes:
        if node.op == "call_function" and recompute_region(node) is None and above[node] == below[node] \
                and len(below[node]) == 1:
            tag_recompute(node, CheckpointPolicy.PREFER_RECOMPUTE, next(iter(below[node])))
    for node in nodes:
        region = recompute_region(node)
        if node.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE \
                and any(recompute_region(user) != region for user in node.users):
            tag_recompute(node, CheckpointPolicy.MUST_SAVE, region)


def _regions(node: fx.Node, untagged: dict[fx.Node, set]) -> set:
    """The regions ``node`` belongs to: its own, or for an untagged node those found beyond it."""
    if recompute_region(node) is not None:
        return {recompute_region(node)}
    return untagged.get(node, set())
