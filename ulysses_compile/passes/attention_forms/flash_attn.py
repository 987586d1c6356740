"""flash-attn's kernels as ``recognize_flash_attention`` leaves them: ``flash_attention(q, k, v, ...)``
on ``[B, S, H, D]`` and ``flash_attention_varlen`` on packed ``[total, H, D]`` with the sequences'
offsets; KV may have fewer heads (flash-attn's own MQA/GQA); ALiBi slopes carry heads. Under a ring,
``flash_attention`` without a window, soft-capping or ALiBi runs as the SDPA call it computes, on q, k,
v transposed to ``[B, H, S, D]`` and its result back."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import fill_example_values
from ulysses_compile.core.random_draws import value_at_compile
from ulysses_compile.core.report import module_path
from ulysses_compile.core.runtime import flash_attention, flash_attention_varlen
from ulysses_compile.core.sharding import REPLICATE, Shard
from ulysses_compile.core.sizes import same_size
from ulysses_compile.passes.attention_forms import FORMS, AttentionForm, Slot, global_value_of, read_site, value_of
from ulysses_compile.passes.attention_forms.sdpa import SDPA, ring_inputs_blocker
from ulysses_compile.passes.rules import Decision, register


class FlashAttention(AttentionForm):
    targets = (flash_attention,)
    per_head_inputs = {"alibi_slopes": 1}  # [heads] or [batch, heads]
    spelling, head_axis, seq_axis = "flash_attn", 2, 1

    def read(self, node):
        if (dropout := _kernel_dropout(node.kwargs["dropout_p"])) is not None:
            return dropout
        slots = {"query": Slot(node, 0), "key": Slot(node, 1), "value": Slot(node, 2)}
        if isinstance(node.kwargs.get("alibi_slopes"), fx.Node):
            slots["alibi_slopes"] = Slot(node, "alibi_slopes")
        return read_site(node, self, self.spelling, module_path(node), slots, head_axis=self.head_axis,
                         seq_axis=self.seq_axis, is_causal=node.kwargs["causal"], side_inputs=self.offsets(node))

    def offsets(self, node) -> tuple:
        return ()

    def mask_kinds(self, site) -> list[str]:
        kinds = [f"window {site.node.kwargs['window_size']}"] if site.node.kwargs["window_size"] != (-1, -1) else []
        if site.side_inputs:
            kinds.append(f"packed sequences (cu_seqlens {list(value_of(site.side_inputs[0]).shape)})")
        return kinds + [f"alibi {list(global_value_of(slopes).shape)}" for slopes in site.per_head_inputs().values()]


    def ring_blocker(self, site, world_size):
        options = site.node.kwargs
        if options["window_size"] != (-1, -1):
            return f"its sliding window (window_size={options['window_size']}) is not read per block of a ring"
        if options["softcap"]:
            return f"its soft-capping (softcap={options['softcap']}) is not applied per block of a ring"
        if isinstance(options.get("alibi_slopes"), fx.Node):
            return "its ALiBi slopes are not applied per block of a ring"
        if site.is_causal and not same_size(site.seq_len, site.kv_seq_len):
            return "causal over a query and a key/value of different lengths (flash-attn aligns the triangle " \
                   "to the last key, a ring's causal blocks to the first)"
        return ring_inputs_blocker(site, [], world_size)

    def as_ring_site(self, site):
        """``scaled_dot_product_attention(q^T, k^T, v^T, is_causal=causal, scale=softmax_scale)^T``
        (``^T``: dims 1 and 2 swapped; the result contiguous, as flash-attn's, for views of it) in place of
        the call, read as an SDPA site (``read`` refused kernel dropout)."""
        graph, call = site.node.graph, site.node
        before = set(graph.nodes)
        query, key, value = (site.entering(role) for role in ("query", "key", "value"))
        grouped = value_of(key).shape[2] != value_of(query).shape[2]
        with graph.inserting_before(call):
            heads_first = [graph.call_method("transpose", (x, 1, 2)) for x in (query, key, value)]
            sdpa = graph.call_function(torch._C._nn.scaled_dot_product_attention, tuple(heads_first), {
                "scale": call.kwargs["softmax_scale"], "is_causal": call.kwargs["causal"],
                **({"enable_gqa": True} if grouped else {})})
            output = graph.call_method("contiguous", (graph.call_method("transpose", (sdpa, 1, 2)),))
        fill_example_values([node for node in graph.nodes if node not in before], call)
        call.replace_all_uses_with(output)
        graph.erase_node(call)
        return replace(SDPA.read(sdpa), spelling=f"{site.spelling} as scaled_dot_product_attention")


class FlashAttentionVarlen(FlashAttention):
    targets = (flash_attention_varlen,)
    spelling, head_axis, seq_axis = "flash_attn_varlen", 1, 0

    def offsets(self, node) -> tuple:
        return tuple(node.args[3:5])  # cu_seqlens_q, cu_seqlens_k: global positions, kept whole

    def ring_blocker(self, site, world_size):
        return "its sequences are packed in one dim (varlen), which a ring's blocks do not follow yet"


def _kernel_dropout(dropout_p) -> str | None:
    """Why flash-attn with this ``dropout_p`` runs whole: the kernel draws its mask from the CUDA
    generator, in the same state on every rank, so heads split over the ranks would share masks; whole,
    every rank draws one device's mask for every head (SDPA's dropout is split: ``attention_heads_dropout``).
    A ``dropout_p`` that ``dynamic=True`` made symbolic counts at the call compiled (a module attribute set
    to 0)."""
    if value_at_compile(dropout_p) == 0:
        return None
    return (f"flash-attn's dropout inside the kernel (dropout_p={getattr(dropout_p, 'name', dropout_p)}) would draw "
            f"the same mask for the heads of every rank; it runs whole on every rank (one device's masks). Set the "
            f"attention dropout to 0, or use SDPA (attn_implementation=\"sdpa\"), whose dropout runs split, to "
            f"parallelize it")


@register(flash_attention)
def flash_attention_rule(node, view):
    """flash-attn on [B, S, H, D]: q, k, v sharded on dim 1; ALiBi slopes whole."""
    return _flash_decision(node, seq_axis=1, whole=("alibi_slopes",))


@register(flash_attention_varlen)
def flash_attention_varlen_rule(node, view):
    """flash-attn varlen on packed [total, H, D]: q, k, v sharded on dim 0; the sequences' offsets
    (global positions) and ALiBi slopes whole."""
    return _flash_decision(node, seq_axis=0, whole=("alibi_slopes",), whole_args=node.args[3:5])


def _flash_decision(node, seq_axis: int, whole: tuple, whole_args: tuple = ()) -> Decision | None:
    if _kernel_dropout(node.kwargs.get("dropout_p", 0.0)) is not None:
        return None  # runs whole (``read`` says why)
    q, k, v = node.args[:3]
    demands = {q: Shard(seq_axis), k: Shard(seq_axis), v: Shard(seq_axis)}
    for arg in (*whole_args, *(node.kwargs.get(name) for name in whole)):
        if isinstance(arg, fx.Node):
            demands[arg] = REPLICATE
    return Decision(Shard(seq_axis), demands)


FORMS.extend((FlashAttention(), FlashAttentionVarlen()))
