"""``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)`` on
``[..., heads, seq, head_dim]``: the mask arrives whole and is narrowed to the rank's heads where it has
them; with ``dropout_p > 0`` the call becomes ``attention_heads_dropout``, whose draws are seeded apart on
each rank so that heads on different ranks get independent masks."""

from __future__ import annotations

import torch
import torch.fx as fx

from ulysses_compile.core.random_draws import random_draw
from ulysses_compile.core.report import module_path
from ulysses_compile.core.ring_attention import ring_attention
from ulysses_compile.core.runtime import attention_heads_dropout
from ulysses_compile.core.sharding import REPLICATE, Shard
from ulysses_compile.core.sizes import same_size
from ulysses_compile.passes.attention_forms import FORMS, AttentionForm, Slot, global_value_of, read_site, value_of
from ulysses_compile.passes.rules import Decision, register

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(node: fx.Node) -> dict:
    bound = dict(zip(SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


class ScaledDotProductAttention(AttentionForm):
    targets = SDPA_TARGETS
    per_head_inputs = {"attn_mask": 3}  # broadcast against [..., heads, query, key]

    def read(self, node):
        args = sdpa_arguments(node)
        q = value_of(args["query"])
        if q.dim() < 3:
            return (f"scaled_dot_product_attention on a query of shape {list(q.shape)} has no head dim to split "
                    f"over the ranks (expected [..., heads, sequence, head_dim]); it runs whole on every rank")
        slots = {}
        for name in ("query", "key", "value", "attn_mask"):
            if SDPA_PARAMS.index(name) < len(node.args):
                slots[name] = Slot(node, SDPA_PARAMS.index(name))
            elif name in node.kwargs:
                slots[name] = Slot(node, name)
        return read_site(node, self, "scaled_dot_product_attention", module_path(node), slots,
                         is_causal=bool(args.get("is_causal", False)))

    def ring_blocker(self, site, world_size):
        if random_draw(site.node) is not None:
            return "its dropout (dropout_p > 0) is not drawn per block of a ring"
        if site.is_causal and not same_size(site.seq_len, site.kv_seq_len):
            return "is_causal over a query and a key/value of different lengths"
        mask = site.entering("attn_mask") if "attn_mask" in site.slots else None
        return ring_inputs_blocker(site, [mask] if isinstance(mask, fx.Node) else [], world_size)

    def to_ring(self, site, group_name, head_tail: bool):
        args = sdpa_arguments(site.node)
        site.node.target = ring_attention
        site.node.args = (args["query"], args["key"], args["value"])
        site.node.kwargs = {"attn_mask": args.get("attn_mask"), "is_causal": bool(args.get("is_causal", False)),
                            "scale": args.get("scale"), "group_name": group_name,
                            **({"head_tail": True} if head_tail else {})}

    def on_rank_heads(self, site, ctx) -> None:
        super().on_rank_heads(site, ctx)
        if random_draw(site.node) is not None:
            site.node.target = attention_heads_dropout
            site.node.kwargs = {**site.node.kwargs, "rank": ctx.rank_for(site.node.graph)}


def ring_inputs_blocker(site, masks: list[fx.Node], world_size: int) -> str | None:
    """Why the masks or the lengths of a site keep it from running as a ring of ``world_size`` ranks'
    blocks, or None."""
    if any(global_value_of(mask).requires_grad for mask in masks):
        return "its mask requires grad (a ring computes no mask gradient)"
    for length in (site.seq_len, site.kv_seq_len):
        if not isinstance(length, int):
            return (f"its sequence length {length} changes between calls (a symbolic size), and a ring runs "
                    f"fixed lengths so far: compile with dynamic=False (one graph per length)")
        if length % world_size:
            return f"its sequence of {length} positions does not split in {world_size} blocks of one size"
    return None


@register(*SDPA_TARGETS)
def sdpa_rule(node, view):
    """Sequence-sharded q, k, v in and out; the mask whole (each rank attends over the whole sequence)."""
    args = sdpa_arguments(node)
    q, k, v, mask = args["query"], args["key"], args["value"], args.get("attn_mask")
    if view.value(q).dim() < 3:
        return None  # no head dim: not a site (its reason is reported), computed on whole inputs
    seq_axis = view.value(q).dim() - 2
    demands = {q: Shard(seq_axis), k: Shard(seq_axis), v: Shard(seq_axis)}
    if isinstance(mask, fx.Node):
        demands[mask] = REPLICATE
    return Decision(Shard(seq_axis), demands)


SDPA = ScaledDotProductAttention()
FORMS.append(SDPA)
