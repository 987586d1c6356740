"""Turn each attention site's sequence sharding into head sharding and back.

Before (q, k, v are ``[B, H, S/P, D]`` on each rank after redistribution)::

    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)

After::

    q_h = seq_to_heads(q, 2, 1, P, group)        # [B, H/P, S, D]
    k_h = seq_to_heads(k, 2, 1, P, group)        # [B, Hkv/P, S, D]: GQA moves only the KV heads
    v_h = seq_to_heads(v, 2, 1, P, group)
    mask_h = narrow(mask, 1, rank * H/P, H/P)     # only when the mask has a head dim of size H
    out_h = scaled_dot_product_attention(q_h, k_h, v_h, attn_mask=mask_h, is_causal=True)
    out = heads_to_seq(out_h, 2, 1, P, group)    # [B, H, S/P, D]

The backward of each all-to-all is the inverse all-to-all (torch's autograd of all_to_all_single).
"""

from __future__ import annotations

import torch.fx as fx

from ulysses_compile.collectives import heads_to_seq, insert_call, seq_to_heads
from ulysses_compile.sharding import PLACEMENT_KEY, NodeSharding, Shard, sharding_of

from .detect_attention import SDPA_PARAMS


def insert_all_to_all(gm: fx.GraphModule, ctx) -> None:
    graph = gm.graph
    for site in ctx.sites:
        node = site.node
        group = (site.seq_axis, site.head_axis, ctx.world_size, ctx.group_name)
        args = list(node.args)
        kwargs = dict(node.kwargs)

        def replace(name, transform):
            if SDPA_PARAMS.index(name) < len(args):
                position = SDPA_PARAMS.index(name)
                args[position] = transform(args[position])
            elif kwargs.get(name) is not None:
                kwargs[name] = transform(kwargs[name])

        by_heads = Shard(site.head_axis)
        for name in ("query", "key", "value"):
            replace(name, lambda x: _mark(insert_call(graph, seq_to_heads, (x, *group), before=node), by_heads, x))
        if site.kv_repeat > 1 and _sharded_on(site.key_source, site.seq_axis) and _sharded_on(
            site.value_source, site.seq_axis
        ):
            for name, source in (("key", site.key_source), ("value", site.value_source)):
                replace(name, lambda old: _repeat_after_all_to_all(graph, node, old, source, site, group))
        replace("attn_mask", lambda mask: _mask_for_rank_heads(graph, node, mask, ctx))
        node.args, node.kwargs = tuple(args), kwargs
        back = _mark(insert_call(graph, heads_to_seq, (node, *group), after=node), Shard(site.seq_axis), node)
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        _mark(node, by_heads, node)


def repeat_heads(x, head_axis: int, repeat: int):
    """Each head ``repeat`` times in a row, as HF's repeat_kv does; on this rank's heads only."""
    shape = list(x.shape)
    expanded = x.unsqueeze(head_axis + 1).expand(*shape[: head_axis + 1], repeat, *shape[head_axis + 1 :])
    shape[head_axis] *= repeat
    return expanded.reshape(shape)


def _sharded_on(node: fx.Node, dim: int) -> bool:
    sharding = sharding_of(node)
    return sharding is not None and sharding.output == Shard(dim)


def _repeat_after_all_to_all(graph, site_node, replaced_all_to_all, source, site, group):
    """Send the un-repeated KV heads and repeat them locally, instead of sending repeated heads."""
    repeated_chain = replaced_all_to_all.args[0]
    graph.erase_node(replaced_all_to_all)
    heads = _mark(insert_call(graph, seq_to_heads, (source, *group), before=site_node), Shard(site.head_axis), source)
    repeated = insert_call(graph, repeat_heads, (heads, site.head_axis, site.kv_repeat), before=site_node)
    _mark(repeated, Shard(site.head_axis), repeated_chain)
    _erase_if_unused(graph, repeated_chain)
    return repeated


def _erase_if_unused(graph, reshaped: fx.Node) -> None:
    """Drop the repeat chain (reshape <- expand <- unsqueeze) where nothing else uses it."""
    chain = [reshaped, reshaped.args[0], reshaped.args[0].args[0]]
    for node in chain:
        if node.users:
            return
        graph.erase_node(node)


def _mark(node: fx.Node, placement, like: fx.Node) -> fx.Node:
    """The new node holds ``like``'s global value in ``placement``."""
    node.meta[PLACEMENT_KEY] = NodeSharding(placement, sharding_of(like).global_value)
    return node


def _mask_for_rank_heads(graph, site_node, mask, ctx):
    if not isinstance(mask, fx.Node):
        return mask
    value = sharding_of(mask).global_value
    head_dim = value.dim() - 3  # masks broadcast against [..., heads, query, key]
    if head_dim < 0 or value.shape[head_dim] == 1:
        return mask
    heads = value.shape[head_dim] // ctx.world_size
    with graph.inserting_before(site_node):
        narrowed = graph.call_method("narrow", (mask, head_dim, ctx.rank * heads, heads))
    narrowed.meta["ulysses_inserted"] = "mask_heads"
    return _mark(narrowed, Shard(head_dim), mask)

