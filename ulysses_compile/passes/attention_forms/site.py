"""An attention site as a form reads it off the graph: where q, k, v (and any per-head input) enter it,
its sizes and layout, and any repeat of KV heads written in front of it."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.fx as fx

from ulysses_compile.core.errors import UnsupportedError
from ulysses_compile.core.sharding import RingShard, seq_shard, sharding_of
from ulysses_compile.core.sizes import is_symbolic, same_size

if TYPE_CHECKING:
    from ulysses_compile.passes.attention_forms import AttentionForm


class Slot(NamedTuple):
    """Where a value enters a site: an argument (index or keyword) of one of the site's own nodes. Passes
    replace the arguments of those nodes, never the nodes, so a slot always holds what enters now."""

    consumer: fx.Node
    argument: int | str

    def read(self):
        return self.consumer.args[self.argument] if isinstance(self.argument, int) \
            else self.consumer.kwargs[self.argument]

    def write(self, value) -> None:
        if isinstance(self.argument, int):
            args = list(self.consumer.args)
            args[self.argument] = value
            self.consumer.args = tuple(args)
        else:
            self.consumer.kwargs = {**self.consumer.kwargs, self.argument: value}


@dataclass(frozen=True)
class AttentionSite:
    node: fx.Node
    form: "AttentionForm"
    spelling: str  # how the model wrote it, as reports show it: "scaled_dot_product_attention", "einsum_softmax"...
    module: str
    # Where q, k, v (and the form's per-head inputs: an SDPA mask, flash-attn's ALiBi slopes) enter the
    # site: role -> Slot. Passes read what enters through these, which stay true as the graph changes.
    slots: dict[str, Slot]
    is_causal: bool
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    kv_seq_len: int
    head_axis: int  # the tensor dim of q/k/v that holds heads ([.., H, S, D] -> ndim - 3)
    seq_axis: int
    # GQA/MQA written as repeat_kv (unsqueeze + expand + reshape, or repeat_interleave) before the call:
    # the un-repeated key/value and the repeat factor, so only the un-repeated heads are communicated.
    key_source: fx.Node | None = None
    value_source: fx.Node | None = None
    kv_repeat: int = 1
    scores: fx.Node | None = None  # hand-written attention: the q @ k^T node (``node``: probs @ v, or its scaling)
    side_inputs: tuple = ()  # what else the scores are combined with (masks, biases, offsets): kept whole
    output_marker: fx.Node | None = None  # hand-written attention: its ``attention_output`` marker
    # Hand-written attention's nodes that run on this rank's heads: node -> (its head dim, the head dim
    # of inputs whose layout differs from its own).
    region: dict = field(default_factory=dict)
    # Heads merged after a batch of this size in one dim, as ``[B*H, S, D]`` that the model views as
    # ``[B, H, S, S]`` between the products (Bloom): each batch's heads split over the ranks.
    heads_outer: int = 1

    # The plan: heads split over Ulysses groups of ``ulysses`` ranks, key/value blocks travelling round
    # a ring of ``ring`` ranks (``ring`` 1: Ulysses over the whole group)
    ulysses: int = 1
    ring: int = 1
    # Decoding: fewer queries than ranks, keys and values the rank's heads of a head-sharded KV cache (a
    # graph before this one left them so): q, k, v and the output on the rank's heads, no all-to-all
    on_cache_heads: bool = False
    # A later prompt over such a cache (P or more new tokens: a second turn, chunked prefill): the keys
    # and values (the cache joined with the new ones) on the rank's heads; only q goes to the heads by
    # all-to-all, and the output back
    kv_on_cache_heads: bool = False
    decision: str = ""  # what the rewrite does at this world size

    def merged_heads_args(self) -> tuple:
        """The ``heads_outer`` argument of the calls that move this site's heads (all-to-alls, the output
        marker) where heads are merged with a batch; left out otherwise."""
        return (self.heads_outer,) if self.heads_outer > 1 else ()

    def heads_placement(self, axis: int | None = None):
        """This rank's heads along ``axis`` (default: q's head dim), within each batch when merged; under
        a ring, with its chunk of the sequence."""
        axis = self.head_axis if axis is None else axis
        if self.ring > 1:
            return RingShard(axis, self.ulysses, self.seq_axis)
        return seq_shard(axis, outer=self.heads_outer)

    def entering(self, role: str) -> fx.Node:
        """The value that enters the site as ``role`` ("query", "key", "value", "attn_mask", ...)."""
        return self.slots[role].read()

    def per_head_inputs(self) -> dict[str, fx.Node]:
        """The form's per-head inputs this site has (role -> the value entering)."""
        return {role: self.entering(role) for role in self.form.per_head_inputs if role in self.slots
                and isinstance(self.entering(role), fx.Node)}

    def mask_inputs(self) -> tuple:
        return self.side_inputs + tuple(self.per_head_inputs().values())

    def kv_by_all_to_all(self, world_size: int) -> bool:
        """Whether KV heads split over the ranks exactly like the query heads that use them (else each
        rank gathers the KV heads its query heads need)."""
        return self.kv_heads == self.heads or (self.heads % world_size == 0 and self.kv_heads % world_size == 0)

    def layout(self) -> str:
        ndim = value_of(self.entering("query")).dim()
        names = ["B"] * ndim
        names[self.head_axis], names[self.seq_axis], names[-1] = "H", "S", "D"
        if ndim == 3 and self.head_axis == 0:
            names[0] = "B*H"  # bmm on heads merged into the batch
        return "[" + ", ".join(names) + "]"

    def mask_kind(self) -> str:
        return ", ".join((["causal"] if self.is_causal else []) + self.form.mask_kinds(self)) or "none"

    def summary(self) -> str:
        kv = f" (kv {self.kv_heads}{f', repeated x{self.kv_repeat} in the model' if self.kv_repeat > 1 else ''})"
        seq = f"{self.seq_len}" + ("" if same_size(self.kv_seq_len, self.seq_len) else f" -> {self.kv_seq_len}")
        return (
            f"{self.module or self.node.name}: {self.spelling} {self.layout()}, heads {self.heads}{kv}, "
            f"head_dim {self.head_dim}, seq {seq}, mask {self.mask_kind()}; {self.decision}"
        )


def value_of(node) -> torch.Tensor:
    return node.meta["example_value"]


def global_value_of(node) -> torch.Tensor:
    """The whole tensor ``node`` holds a block of once placed (its own value before)."""
    sharding = sharding_of(node)
    return value_of(node) if sharding is None else sharding.global_value


def tensor_kinds(inputs) -> list[str]:
    """``bool [S, S]`` / ``additive [B, 1, S, S]`` for each tensor among ``inputs``."""
    kinds = []
    for node in inputs:
        value = global_value_of(node) if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor):
            kinds.append(f"{'bool' if value.dtype == torch.bool else 'additive'} {list(value.shape)}")
    return kinds


def read_site(node, form, spelling, module, slots, head_axis=None, seq_axis=None, **details) -> AttentionSite:
    """A site with its sizes read off the q and k entering it (by default ``[.., heads, seq, head_dim]``),
    and any KV repeat."""
    q, k = value_of(slots["query"].read()), value_of(slots["key"].read())
    head_axis = q.dim() - 3 if head_axis is None else head_axis
    seq_axis = q.dim() - 2 if seq_axis is None else seq_axis
    fixed = (q.shape[head_axis], k.shape[head_axis], q.shape[-1])
    if any(is_symbolic(size) for size in fixed):
        raise UnsupportedError(
            f"attention {module or node.name}: heads, key/value heads and head dim {fixed} are symbolic; "
            f"only the sequence length may change between calls. Mark only the sequence dim dynamic "
            f"(torch._dynamo.mark_dynamic(x, seq_dim)) or compile with dynamic=False"
        )
    site = AttentionSite(
        node=node, form=form, spelling=spelling, module=module, slots=slots, heads=q.shape[head_axis],
        kv_heads=k.shape[head_axis], head_dim=q.shape[-1], seq_len=q.shape[seq_axis], kv_seq_len=k.shape[seq_axis],
        head_axis=head_axis, seq_axis=seq_axis, **details,
    )
    return _with_kv_repeat(site)


def _with_kv_repeat(site: AttentionSite) -> AttentionSite:
    """Record a repeat of KV heads written in front of the attention (both key and value repeated)."""
    key_source, key_repeat = unrepeated_heads(site.entering("key"), site.head_axis)
    value_source, value_repeat = unrepeated_heads(site.entering("value"), site.head_axis)
    if key_repeat == value_repeat > 1:
        return replace(site, key_source=key_source, value_source=value_source, kv_repeat=key_repeat,
                       kv_heads=site.kv_heads // key_repeat)
    return site


def unrepeated_heads(node: fx.Node, head_axis: int) -> tuple[fx.Node, int]:
    """``(x, n)`` when ``node`` repeats each head of ``x`` n times along ``head_axis``, else ``(node, 1)``.

    Recognizes HF's ``repeat_kv``: ``x[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D)``
    (or ``unsqueeze``), and ``repeat_interleave(x, n, dim=head_axis)``.
    """
    if node.op == "call_method" and node.target == "repeat_interleave" or node.target is torch.repeat_interleave:
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        source = node.args[0]
        if isinstance(repeats, int) and dim is not None and dim % value_of(source).dim() == head_axis:
            return source, repeats
        return node, 1
    if node.op != "call_method" or node.target not in ("reshape", "view"):
        return node, 1
    expanded = node.args[0]
    if not isinstance(expanded, fx.Node) or expanded.op != "call_method" or expanded.target != "expand":
        return node, 1
    unsqueezed = expanded.args[0]
    source = unsqueezed.args[0] if isinstance(unsqueezed, fx.Node) and unsqueezed.args else None
    if not isinstance(source, fx.Node) or not isinstance(value_of(source), torch.Tensor):
        return node, 1
    src, big, out = value_of(source), value_of(expanded), value_of(node)
    inserted_at = head_axis + 1
    shape_ok = (
        big.dim() == src.dim() + 1
        and tuple(big.shape[:inserted_at]) == tuple(src.shape[:inserted_at])
        and tuple(big.shape[inserted_at + 1 :]) == tuple(src.shape[inserted_at:])
        and tuple(out.shape) == (*src.shape[:head_axis], src.shape[head_axis] * big.shape[inserted_at],
                                 *src.shape[head_axis + 1 :])
    )
    if shape_ok and _inserts_dim(unsqueezed, inserted_at, src.dim() + 1):
        return source, big.shape[inserted_at]
    return node, 1


def _inserts_dim(node: fx.Node, dim: int, ndim: int) -> bool:
    """``node`` is ``x.unsqueeze(dim)`` or ``x[..., None, ...]`` with the None landing at ``dim``."""
    if node.op == "call_method" and node.target == "unsqueeze":
        return node.args[1] % ndim == dim
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return (
            Ellipsis not in index
            and index.count(None) == 1
            and index.index(None) == dim
            and all(entry == slice(None) for entry in index if entry is not None)
        )
    return False
