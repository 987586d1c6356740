"""Attention sites, seen from outside: sequence-sharded q/k/v in, sequence-sharded output out.

Inside, passes/insert_all_to_all.py trades the sequence sharding for head sharding and back. The mask
must arrive whole (Replicate): after the all-to-all each rank attends over the full sequence.
A hand-written attention's head-parallel region is placed by propagate_sharding itself.
"""

from __future__ import annotations

import torch.fx as fx

from ulysses_compile.runtime import attention_output, flash_attention, flash_attention_varlen
from ulysses_compile.sharding import REPLICATE, Shard

from ..detect_attention import SDPA_TARGETS, sdpa_arguments

from . import Decision, register


@register(*SDPA_TARGETS)
def sdpa_rule(node, view):
    args = sdpa_arguments(node)
    q, k, v, mask = args["query"], args["key"], args["value"], args.get("attn_mask")
    if view.value(q).dim() < 3:
        return None  # no head dim: not a site (detect_attention reports it), computed on whole inputs
    seq_axis = view.value(q).dim() - 2
    demands = {q: Shard(seq_axis), k: Shard(seq_axis), v: Shard(seq_axis)}
    if isinstance(mask, fx.Node):
        demands[mask] = REPLICATE
    return Decision(Shard(seq_axis), demands)


@register(flash_attention)
def flash_attention_rule(node, view):
    """flash-attn on [B, S, H, D]: q, k, v sharded on dim 1; ALiBi slopes whole."""
    return _flash_decision(node, seq_axis=1, whole=("alibi_slopes",))


@register(flash_attention_varlen)
def flash_attention_varlen_rule(node, view):
    """flash-attn varlen on packed [total, H, D]: q, k, v sharded on dim 0; the sequences' offsets
    (global positions) and ALiBi slopes whole."""
    return _flash_decision(node, seq_axis=0, whole=("alibi_slopes",), whole_args=node.args[3:5])


def _flash_decision(node, seq_axis: int, whole: tuple, whole_args: tuple = ()) -> Decision:
    q, k, v = node.args[:3]
    demands = {q: Shard(seq_axis), k: Shard(seq_axis), v: Shard(seq_axis)}
    for arg in (*whole_args, *(node.kwargs.get(name) for name in whole)):
        if isinstance(arg, fx.Node):
            demands[arg] = REPLICATE
    return Decision(Shard(seq_axis), demands)


@register(attention_output)
def attention_output_rule(node, view):
    """A hand-written attention's result leaves its heads for the sequence: insert_all_to_all makes
    this marker the all-to-all."""
    x, head_axis, seq_axis = node.args
    return Decision(Shard(seq_axis), {x: Shard(head_axis)})
