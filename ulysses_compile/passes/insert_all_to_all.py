"""Turn each attention site's sequence sharding into head sharding and back (and, for a site planned
with a ring, its call into ring attention).

Before (q, k, v are ``[B, H, S/P, D]`` on each rank after redistribution)::

    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)

After::

    qkv_h = seq_to_heads_qkv(q, k, v, 2, 1, S, S, rank, P, group)   # one all-to-all for the three
    q_h = qkv_h[0]                                      # [B, H/P, S, D]
    k_h = qkv_h[1]                                      # [B, Hkv/P, S, D]: GQA moves only the KV heads
    v_h = qkv_h[2]
    mask_h = take_block(mask, 1, 1, 1, rank, P)          # only when the mask has a head dim of size H
    out_h = scaled_dot_product_attention(q_h, k_h, v_h, attn_mask=mask_h, is_causal=True)
    out = heads_to_seq(out_h, 2, 1, H, rank, P, group)  # [B, H, S/P, D]

``rank`` is the graph's ``rank_of_group(group, device)``, read when it runs, where the lengths and
heads split in blocks of one size; else this rank's number.

Hand-written attention gets the same treatment around its head-parallel region: ``q`` into
``q @ k^T``, ``k`` into its transpose, ``v`` into ``probs @ v``, and ``heads_to_seq`` in place of the
``attention_output`` marker.

What else changes in the call on the rank's heads is the site's form's (``on_rank_heads``): per-head
inputs taken to the rank's heads (``take_block``; one over 65,536 elements by this rank's number, a
view), and SDPA with ``dropout_p > 0`` becomes
``attention_heads_dropout(q_h, k_h, v_h, ..., rank=rank)``, the same kernel with its draws seeded apart
on each rank, so heads on different ranks get independent masks (the kernel draws from the generator,
alike on every rank).

Heads split over ranks in balanced blocks (``sharding.block_sizes``): 6 heads on 4 ranks go 2, 2, 1, 1,
by one all-to-all with split sizes. Heads merged with the batch in one dim (``[B*H, S, D]`` that the
model views as ``[B, H, S, S]`` between the products) split within each batch (``heads_outer=B``). Key/value heads travel by all-to-all when they split like the query
heads, in the query's all-to-all when the three share a dtype and all exist before the first of them is
used (hand-written attention may compute v after the scores: then one all-to-all each); otherwise (MQA,
fewer KV heads than ranks, uneven GQA) each rank gathers the whole sequence of the KV heads its query
heads use (``gather_kv_heads``). A repeat of KV heads written in the model (HF
``repeat_kv``) is redone after the communication, so repeated heads are never sent. The backward of
each all-to-all is the inverse all-to-all (torch's autograd of all_to_all_single).

A site planned with a ring (``detect_attention``: more ranks than heads, or ranks on several nodes) has
its heads split over Ulysses groups of U consecutive ranks, each holding a chunk S/R of the sequence
(contiguous, or chunks i and 2R - 1 - i of 2R in the head-tail layout, ``plan_sequence_layout``), and
its keys and values travel round a ring of the R ranks at one place in every group
(``sequence_subgroups``). At 4 ranks and 2 heads (U = 2, R = 2), head-tail::

    rank_u = rank_of_group(heads_group, device)
    qkv_h = seq_to_heads_qkv(q, k, v, 2, 1, S/R, S/R, rank_u, U, heads_group)  # [B, H/U, S/R, D]
    out_h = ring_attention(qkv_h[0], qkv_h[1], qkv_h[2], attn_mask=mask, is_causal=True, group_name=ring_group,
                           head_tail=True)
    out = heads_to_seq(out_h, 2, 1, H, rank_u, U, heads_group)             # [B, H, S/P, D]

Key/value heads the model repeats travel un-repeated (the ring's kernel broadcasts them); with U = 1
nothing is exchanged by all-to-all and the ring runs on the sequence blocks as they are.

A site that decodes over a key/value cache on the rank's heads (``on_cache_heads``: fewer new tokens
than ranks, ``keep_cache_on_heads``) has q, k, v and its output on the rank's heads already
(``propagate_sharding`` projected them so); only the call is rewritten for them::

    out_h = scaled_dot_product_attention(q_h, k_h, v_h, enable_gqa=True)   # [B, H/P, 1, D]

Pinned on small models: ``tests/test_pass_goldens.py::test_insert_all_to_all`` and
``test_insert_all_to_all_under_a_ring``.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch.fx as fx

from ulysses_compile.core.collectives import (
    gather_kv_heads,
    heads_to_seq,
    insert_call,
    seq_to_heads,
    seq_to_heads_qkv,
    sequence_subgroups,
)
from ulysses_compile.core.runtime import repeat_heads
from ulysses_compile.core.sharding import NodeSharding, Shard, place, placed_as, sharding_of


def insert_all_to_all(gm: fx.GraphModule, ctx, sites: list) -> None:
    graph = gm.graph
    for site in sites:
        if site.on_cache_heads:
            _on_cache_heads(graph, site, ctx)
            continue
        if site.ring == 1:
            _to_heads_and_back(graph, site, ctx)
            continue
        ulysses_group, ring_group = sequence_subgroups(ctx.group_name, site.ulysses)
        if site.ulysses == 1:
            _ring_only(graph, site)
        else:  # each Ulysses group exchanges its chunk of the sequence
            _to_heads_and_back(graph, replace(site, seq_len=site.seq_len // site.ring,
                                              kv_seq_len=site.kv_seq_len // site.ring),
                               ctx.within_ulysses(site.ulysses, ulysses_group))
        site.form.to_ring(site, ring_group, bool(ctx.head_tail))


def _to_heads_and_back(graph: fx.Graph, site, ctx) -> None:
    """q, k, v to the rank's heads over the whole sequence (under a ring: its Ulysses group's chunk),
    the call rewritten for them, its output back to the sequence. Keys and values already on the rank's
    heads (``kv_on_cache_heads``: a key/value cache's) stay as they are: q alone is sent."""
    replaced: list[tuple[fx.Node, fx.Node]] = []
    if site.kv_on_cache_heads or not _fused_qkv(graph, site, ctx, replaced):
        slot = site.slots["query"]
        query = slot.read()
        slot.write(_mark(insert_call(
            graph, seq_to_heads, (query, site.seq_axis, site.head_axis, site.seq_len, _rank(graph, site, ctx), ctx.world_size,
                                  ctx.group_name, *site.merged_heads_args()), before=slot.consumer), site.heads_placement(),
            query))
        for role in () if site.kv_on_cache_heads else ("key", "value"):
            slot = site.slots[role]
            slot.write(_kv_for_rank_heads(graph, slot.consumer, role, site, ctx, replaced))
    site.form.on_rank_heads(site, ctx)
    output = site.form.output(site)
    back = _mark(insert_call(graph, heads_to_seq, (output, site.seq_axis, site.head_axis, site.heads, _rank(graph, site, ctx),
                                             ctx.world_size, ctx.group_name, *site.merged_heads_args()), after=output),
                 Shard(site.seq_axis), output)
    output.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    if site.output_marker is not None:
        site.output_marker.replace_all_uses_with(back)
        graph.erase_node(site.output_marker)
    else:
        _mark(output, site.heads_placement(), output)
    for repeated, source in replaced:
        _erase_unused_chain(graph, repeated, source)


def _on_cache_heads(graph: fx.Graph, site, ctx) -> None:
    """Decoding over a head-sharded key/value cache: q, k, v and the output hold the rank's heads
    (``redistribute`` made them so); only the call is rewritten for them."""
    site.form.on_rank_heads(site, ctx)


def _ring_only(graph: fx.Graph, site) -> None:
    """A ring over every rank: q, k, v stay in their sequence blocks, key/value un-repeated where the
    model repeats their heads (the ring's kernel broadcasts them)."""
    for role in ("key", "value"):
        sent, repeated = _sent(site, role)
        if repeated:
            repeat = site.slots[role].read()
            site.slots[role].write(sent)
            _erase_unused_chain(graph, repeat, sent)


def _fused_qkv(graph, site, ctx, replaced) -> bool:
    """q, k and v to heads by one all-to-all, before the first of their consumers, when the KV heads
    split like the query heads, the three share a dtype and all three exist there; else False."""
    sent = {role: _sent(site, role) for role in ("query", "key", "value")}
    order = {node: index for index, node in enumerate(graph.nodes)}
    first = min((site.slots[role].consumer for role in sent), key=order.__getitem__)
    if not site.kv_by_all_to_all(ctx.world_size) \
            or len({sharding_of(node).global_value.dtype for node, _ in sent.values()}) != 1 \
            or any(order[node] >= order[first] for node, _ in sent.values()):
        return False
    query, key, value = (node for node, _ in sent.values())
    fused = insert_call(graph, seq_to_heads_qkv, (query, key, value, site.seq_axis, site.head_axis, site.seq_len,
                                                  site.kv_seq_len, _rank(graph, site, ctx), ctx.world_size, ctx.group_name,
                                                  *site.merged_heads_args()), before=first)
    place(fused, NodeSharding((site.heads_placement(),) * 3,
                              tuple(sharding_of(node).global_value for node, _ in sent.values())))
    for index, (role, (node, repeated)) in enumerate(sent.items()):
        with graph.inserting_before(first):
            local = _mark(graph.call_function(operator.getitem, (fused, index)), site.heads_placement(), node)
        if repeated:
            kv = site.slots[role].read()
            replaced.append((kv, node))
            if site.ring == 1:
                local = _mark(insert_call(graph, repeat_heads, (local, site.head_axis, site.kv_repeat), before=first),
                              site.heads_placement(), kv)
        site.slots[role].write(local)
    return True


def _sent(site, role: str) -> tuple[fx.Node, bool]:
    """What travels for ``role``, and whether it is the source of a repeat of KV heads written in the
    model (redone after the communication)."""
    read = site.slots[role].read()
    source = {"key": site.key_source, "value": site.value_source}.get(role)
    repeated = source is not None and site.kv_repeat > 1 and placed_as(source, Shard(site.seq_axis))
    return (source if repeated else read), repeated


def _kv_for_rank_heads(graph, before, role: str, site, ctx, replaced) -> fx.Node:
    """Key or value for this rank's query heads, communicating only un-repeated KV heads."""
    kv = site.slots[role].read()
    sent, repeated = _sent(site, role)
    if repeated:
        replaced.append((kv, sent))
    if not site.kv_by_all_to_all(ctx.world_size):
        local = insert_call(graph, gather_kv_heads, (sent, site.seq_axis, site.head_axis, site.kv_seq_len, site.heads,
                                                     _rank(graph, site, ctx), ctx.world_size, ctx.group_name),
                            before=before)
        return place(local, NodeSharding(None, None))  # KV heads picked per query head: no placement
    local = _mark(insert_call(graph, seq_to_heads, (sent, site.seq_axis, site.head_axis, site.kv_seq_len, _rank(graph, site, ctx),
                                                    ctx.world_size, ctx.group_name, *site.merged_heads_args()), before=before),
                  site.heads_placement(), sent)
    if not repeated or site.ring > 1:  # a ring's kernel broadcasts key/value heads
        return local
    return _mark(insert_call(graph, repeat_heads, (local, site.head_axis, site.kv_repeat), before=before),
                 site.heads_placement(), kv)


def _rank(graph: fx.Graph, site, ctx):
    return ctx.rank_for(graph, site.seq_len, site.kv_seq_len, site.heads)


def _erase_unused_chain(graph, repeated: fx.Node, source: fx.Node) -> None:
    """Drop the model's repeat of KV heads (reshape <- expand <- unsqueeze, or repeat_interleave) back
    to its source, where nothing else uses it."""
    node = repeated
    while node is not source and not node.users:
        inputs = node.all_input_nodes
        graph.erase_node(node)
        node = inputs[0]


def _mark(node: fx.Node, placement, like: fx.Node) -> fx.Node:
    """The new node holds ``like``'s global value in ``placement``."""
    return place(node, NodeSharding(placement, sharding_of(like).global_value))
