"""FlexAttention: ``torch.ops.higher_order.flex_attention(q, k, v, score_mod, block_mask, scale,
kernel_options, score_mod_buffers, mask_mod_buffers)`` on ``[B, H, S, D]``, as Dynamo records
``torch.nn.attention.flex_attention.flex_attention``. ``score_mod`` and the block mask's ``mask_mod``
are subgraphs called with (batch, head, query position, key position).

On the rank's heads, each rank calls it on the whole sequence of its block of heads: positions stay
global, so the mods and the block mask built for the whole sequence hold as they are; the mods'
head index is offset by the rank's first head (a mod that reads it, ALiBi say, sees the model's own
head), and block-mask tensors with a heads dim keep the rank's heads. The buffers the mods read
(document ids, ALiBi slopes) arrive whole. A call whose log-sum-exp or max scores are read runs whole.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from ulysses_compile.core.report import module_path
from ulysses_compile.core.sharding import NodeSharding, Shard, block_range, place, sharding_of
from ulysses_compile.passes.attention_forms import FORMS, AttentionForm, Slot, global_value_of, rank_heads_of, read_site
from ulysses_compile.passes.rules import Decision, register

FLEX_ATTENTION = torch.ops.higher_order.flex_attention
_SCORE_MOD, _BLOCK_MASK = 3, 4  # argument positions
_HEAD_ARGUMENT = {_SCORE_MOD: 2, _BLOCK_MASK: 1}  # (score, b, h, q, kv) and mask_mod's (b, h, q, kv)
_BUFFERS = {_SCORE_MOD: 7, _BLOCK_MASK: 8}  # the tuples of the tensors each mod reads after those


class FlexAttention(AttentionForm):
    targets = (FLEX_ATTENTION,)

    def read(self, node):
        if (reason := _runs_whole(node)) is not None:
            return reason
        slots = {"query": Slot(node, 0), "key": Slot(node, 1), "value": Slot(node, 2)}
        return read_site(node, self, "flex_attention", module_path(node), slots, is_causal=False,
                         side_inputs=tuple(node.args[_BLOCK_MASK][index] for index in _block_mask_tensors(node)))

    def mask_kinds(self, site) -> list[str]:
        tensors = _block_mask_tensors(site.node)
        kv_num_blocks = global_value_of(site.node.args[_BLOCK_MASK][tensors[0]]) if tensors else None
        kinds = [f"block mask over [B, H] {list(kv_num_blocks.shape[:2])}" if tensors else "no block mask"]
        return kinds + [f"{name} reads the head" for name, index in (("score_mod", _SCORE_MOD), ("mask_mod", _BLOCK_MASK))
                        if _head_reads(_mod(site.node, index), index)]

    def output(self, site) -> fx.Node:
        return next(iter(site.node.users))

    def on_rank_heads(self, site, ctx) -> None:
        node = site.node
        results = list(node.users)
        for duplicate in results[1:]:  # each reads element 0 (``read``): one all-to-all back serves them all
            duplicate.replace_all_uses_with(results[0])
            node.graph.erase_node(duplicate)
        rank = ctx.rank_for(node.graph, site.heads)
        first = block_range(site.heads, ctx.world_size, rank)[0] if isinstance(rank, int) else None
        args = list(node.args)
        block_mask = list(args[_BLOCK_MASK])
        for index in _block_mask_tensors(node):
            if global_value_of(block_mask[index]).shape[1] == site.heads:
                block_mask[index] = rank_heads_of(block_mask[index], 1, node, ctx)
        args[_BLOCK_MASK] = tuple(block_mask)
        for index in (_SCORE_MOD, _BLOCK_MASK):
            mod = _mod_node(args, index)
            if mod is not None and first != 0 and _head_reads(_mod(node, index), index):
                first = _first_head(node, rank, site.heads // ctx.world_size) if first is None else first
                offset = _offset_heads(mod, index, first)
                args[index] = offset if index == _SCORE_MOD else (*args[_BLOCK_MASK][:-1], offset)
                if isinstance(first, fx.Node):  # read by the mod as its last buffer
                    args[_BUFFERS[index]] = (*args[_BUFFERS[index]], first)
        node.args = tuple(args)
        global_values = sharding_of(node).global_value
        place(node, NodeSharding(tuple(Shard(site.head_axis) for _ in global_values), global_values))


def _runs_whole(node) -> str | None:
    """Why this call runs whole on every rank: more of its results than the output are read."""
    if any(user.target is not operator.getitem or user.args[1] != 0 for user in node.users) or not node.users:
        return ("flex_attention's log-sum-exp or max scores (return_lse / return_aux) are read beside its output; "
                "only the output is split over the ranks' heads, so the call runs whole on every rank")
    return None


def _block_mask_tensors(node) -> list[int]:
    """Where the block mask's tensors ([B, H, ...] each) are in its tuple (its lengths may be symbolic)."""
    return [index for index, entry in enumerate(node.args[_BLOCK_MASK])
            if isinstance(entry, fx.Node) and isinstance(entry.meta.get("example_value"), torch.Tensor)]


def _mod_node(args, index) -> fx.Node | None:
    mod = args[index] if index == _SCORE_MOD else args[_BLOCK_MASK][-1]
    return mod if isinstance(mod, fx.Node) and mod.op == "get_attr" else None


def _mod(node, index) -> fx.GraphModule | None:
    mod = _mod_node(node.args, index)
    return getattr(node.graph.owning_module, mod.target) if mod is not None else None


def _head_reads(mod: fx.GraphModule | None, index: int) -> bool:
    if mod is None:
        return False
    inputs = [arg for arg in mod.graph.nodes if arg.op == "placeholder"]
    return len(inputs) > _HEAD_ARGUMENT[index] and bool(inputs[_HEAD_ARGUMENT[index]].users)


def _first_head(node: fx.Node, rank: fx.Node, heads_per_rank: int) -> fx.Node:
    """The rank's first head, computed before ``node`` from the rank read at run time (on the graph's
    device, as the mods' buffers are)."""
    with node.graph.inserting_before(node):
        return node.graph.call_function(operator.mul, (rank, heads_per_rank))


def _offset_heads(mod_node: fx.Node, index: int, first) -> fx.Node:
    """A copy of the mod whose head argument is offset by ``first``, fetched where ``mod_node`` is:
    an int, or a tensor read at run time (the rank's first head), which the copy reads as a new last
    buffer."""
    owner = mod_node.graph.owning_module
    offset = copy.deepcopy(getattr(owner, mod_node.target))
    placeholders = [arg for arg in offset.graph.nodes if arg.op == "placeholder"]
    head = placeholders[_HEAD_ARGUMENT[index]]
    if isinstance(first, fx.Node):
        with offset.graph.inserting_after(placeholders[-1]):
            first = offset.graph.placeholder("first_head")
    with offset.graph.inserting_after(first if isinstance(first, fx.Node) else head):
        shifted = offset.graph.call_function(operator.add, (head, first))
    head.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)
    offset.recompile()
    name = f"{mod_node.target}_heads_from_{first if isinstance(first, int) else 'rank'}"
    owner.register_module(name, offset)
    with mod_node.graph.inserting_after(mod_node):
        return mod_node.graph.get_attr(name)


@register(FLEX_ATTENTION)
def flex_attention_rule(node, view):
    """Sequence-sharded q, k, v in, the output (and its log-sum-exp) sequence-sharded out; the block
    mask and the mods' buffers whole."""
    if _runs_whole(node) is not None:
        return None
    q, k, v = node.args[:3]
    seq_axis = view.value(q).dim() - 2
    outputs = view.value(node)
    return Decision(tuple(Shard(seq_axis) for _ in outputs), {q: Shard(seq_axis), k: Shard(seq_axis),
                                                             v: Shard(seq_axis)})


FORMS.append(FlexAttention())
