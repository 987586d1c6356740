"""The ways a graph calls attention, one class per form, one file each.

A form knows which nodes are its own (``reads``), how to read a site off one (``read``: an
:class:`AttentionSite`, a reason it cannot be parallelized, or None when the node is no attention), how
the site looks from outside to sharding propagation (its ``rules``: sequence-sharded q, k, v in, the
output sequence-sharded), which inputs carry a heads dim (``per_head_inputs``), and what changes in
the call once q, k and v hold the rank's heads for the whole sequence (``on_rank_heads``). The passes
ask the site's form, never its name.

Adding a form is one new file here (imported below) and one entry in ``tests/attention_forms.py``; the
recipe is in docs/how-it-works.md.
"""

from __future__ import annotations

import torch.fx as fx

from ulysses_compile.core.collectives import take_block
from ulysses_compile.core.sharding import NodeSharding, place, sharding_of
from ulysses_compile.core.sizes import is_symbolic
from ulysses_compile.passes.attention_forms.site import AttentionSite, Slot, global_value_of, read_site, tensor_kinds, value_of

__all__ = ["FORMS", "AttentionForm", "AttentionSite", "Slot", "global_value_of", "read_site", "reading_form", "value_of"]


class AttentionForm:
    targets: tuple = ()  # the targets of the nodes this form reads
    # Inputs besides q, k, v that carry heads: role -> their heads dim counted from the end.
    per_head_inputs: dict[str, int] = {}

    def reads(self, node: fx.Node) -> bool:
        return node.op in ("call_function", "call_method") and node.target in self.targets

    def read(self, node: fx.Node) -> "AttentionSite | str | None":
        """The site, or why the call runs whole (its sharding rule must then refuse it too), or None."""
        raise NotImplementedError

    def mask_kinds(self, site: AttentionSite) -> list[str]:
        """What masks the attention beside ``is_causal``, for reports."""
        return tensor_kinds((*site.side_inputs, *site.per_head_inputs().values()))

    def output(self, site: AttentionSite) -> fx.Node:
        """The node holding the attention's result on the rank's heads."""
        return site.node

    def ring_blocker(self, site: AttentionSite, world_size: int) -> str | None:
        """Why the site cannot run as a ring over ``world_size`` ranks' blocks of the sequence, or None."""
        return f"ring attention runs scaled_dot_product_attention calls so far, not {site.spelling}"

    def as_ring_site(self, site: AttentionSite) -> AttentionSite:
        """The site as it runs as a ring (``ring_blocker`` said it can): itself, or the call of a form
        that has a ring put in the graph in its place."""
        return site

    def to_ring(self, site: AttentionSite, group_name: str, head_tail: bool) -> None:
        """Turn the call on the rank's heads into ring attention round the ring ``group_name``, its blocks
        in the head-tail layout where ``head_tail``."""
        raise NotImplementedError

    def on_rank_heads(self, site: AttentionSite, ctx) -> None:
        """Rewrite the call for q, k, v that hold this rank's heads: per-head inputs narrowed to them."""
        for role, from_end in self.per_head_inputs.items():
            if role in site.slots:
                narrow_heads(site.slots[role], site.node, from_end, ctx)


def narrow_heads(slot: Slot, before: fx.Node, from_end: int, ctx) -> None:
    """What enters ``slot``, narrowed to this rank's block of its heads dim (``from_end`` dims from its
    last) where that dim is not broadcast."""
    whole = slot.read()
    if not isinstance(whole, fx.Node):
        return
    value = sharding_of(whole).global_value
    head_dim = value.dim() - from_end
    if head_dim >= 0 and value.shape[head_dim] != 1:
        slot.write(rank_heads_of(whole, head_dim, before, ctx))


_COPIED_HEADS_ELEMENTS = 2**16


def rank_heads_of(whole: fx.Node, head_dim: int, before: fx.Node, ctx) -> fx.Node:
    """``whole`` narrowed to this rank's block of ``head_dim``, computed just before ``before``. By the
    rank read at run time where the value is small (ALiBi slopes, sinks): that takes a copy; a larger
    one (a per-head mask or bias, S x S a head) is viewed by this rank's number."""
    value = sharding_of(whole).global_value
    small = not is_symbolic(value.numel()) and value.numel() <= _COPIED_HEADS_ELEMENTS
    rank = ctx.rank_for(before.graph, value.shape[head_dim]) if small else ctx.rank
    with before.graph.inserting_before(before):
        narrowed = before.graph.call_function(take_block, (whole, head_dim, 1, 1, rank, ctx.world_size))
    return place(narrowed, NodeSharding(ctx.heads_shard(head_dim), value))


FORMS: list[AttentionForm] = []


def reading_form(node: fx.Node) -> AttentionForm | None:
    return next((form for form in FORMS if form.reads(node)), None)


# Importing the forms fills FORMS.
from ulysses_compile.passes.attention_forms import flash_attn, flex_attention, handwritten, sdpa  # noqa: E402,F401
