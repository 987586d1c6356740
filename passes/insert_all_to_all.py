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

With fewer KV heads than ranks (MQA, or GQA with P a multiple of the KV heads) each rank instead
gathers the whole sequence of the one KV head its query heads use (``gather_kv_heads``). A repeat of
KV heads written in the model (HF ``repeat_kv``) is moved after the communication, so repeated heads are
never sent. The backward of each all-to-all is the inverse all-to-all (torch's autograd of
all_to_all_single).
"""

from __future__ import annotations

import torch.fx as fx

from ulysses_compile.collectives import gather_kv_heads, heads_to_seq, insert_call, seq_to_heads
from ulysses_compile.sharding import PLACEMENT_KEY, NodeSharding, Shard, sharding_of

from .detect_attention import SDPA_PARAMS


def insert_all_to_all(gm: fx.GraphModule, ctx) -> None:
    graph = gm.graph
    for site in ctx.sites:
        if site.scores is not None:
            continue  # hand-written attention: redistribute already placed its all-to-alls
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

        replaced: list[fx.Node] = []
        replace("query", lambda q: _mark(insert_call(graph, seq_to_heads, (q, *group), before=node),
                                         Shard(site.head_axis), q))
        for name, source in (("key", site.key_source), ("value", site.value_source)):
            replace(name, lambda kv: _kv_for_rank_heads(graph, node, kv, source, site, ctx, replaced))
        replace("attn_mask", lambda mask: _mask_for_rank_heads(graph, node, mask, ctx))
        node.args, node.kwargs = tuple(args), kwargs
        back = _mark(insert_call(graph, heads_to_seq, (node, *group), after=node), Shard(site.seq_axis), node)
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        _mark(node, Shard(site.head_axis), node)
        for chain in replaced:
            _erase_if_unused(graph, chain)


def repeat_heads(x, head_axis: int, repeat: int):
    """Each head ``repeat`` times in a row, as HF's repeat_kv does; on this rank's heads only."""
    shape = list(x.shape)
    expanded = x.unsqueeze(head_axis + 1).expand(*shape[: head_axis + 1], repeat, *shape[head_axis + 1 :])
    shape[head_axis] *= repeat
    return expanded.reshape(shape)


def _sharded_on(node: fx.Node | None, dim: int) -> bool:
    sharding = sharding_of(node) if node is not None else None
    return sharding is not None and sharding.output == Shard(dim)


def _kv_for_rank_heads(graph, site_node, kv, source, site, ctx, replaced) -> fx.Node:
    """Key or value for this rank's query heads. Communicates un-repeated KV heads: by all-to-all when
    they divide over the ranks, else each rank gathers the one KV head its query heads share; a repeat
    written in the model (repeat_kv) is redone locally afterwards."""
    repeated = site.kv_repeat > 1 and _sharded_on(source, site.seq_axis)
    sent = source if repeated else kv
    heads = sharding_of(sent).global_value.shape[site.head_axis]
    if heads % ctx.world_size == 0:
        local = _mark(insert_call(graph, seq_to_heads, (sent, site.seq_axis, site.head_axis, ctx.world_size,
                                                        ctx.group_name), before=site_node), Shard(site.head_axis), sent)
        local_heads = heads // ctx.world_size
    else:
        local = insert_call(graph, gather_kv_heads, (sent, site.seq_axis, site.head_axis, ctx.rank, ctx.world_size,
                                                     ctx.group_name), before=site_node)
        local.meta[PLACEMENT_KEY] = NodeSharding(None, None)  # one whole head: no placement describes it
        local_heads = 1
    if not repeated:
        return local
    replaced.append(kv)
    repeat = site.heads // ctx.world_size // local_heads
    return _mark(insert_call(graph, repeat_heads, (local, site.head_axis, repeat), before=site_node),
                 Shard(site.head_axis), kv)


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

