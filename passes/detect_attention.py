"""Find every attention site in a Dynamo graph and decide, up front, whether it can be parallelized.

Before (a Dynamo graph)::

    attn = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, ...)
    probs = F.softmax(q @ k.transpose(-2, -1) * scale + mask, dim=-1)       # written by hand
    out = probs @ v

After: the hand-written result passes through ``attention_output(out)`` (an identity that marks where
the head-parallel region ends); otherwise the graph is unchanged. It returns a :class:`Detection`: one
:class:`AttentionSite` per call, with its module path, heads, KV heads, head dim, sequence lengths and
mask, and why each softmax or SDPA that is not a site is not. A site with fewer heads than ranks raises
here, before any rewrite. A symbolic sequence length is guarded to its class
(``sizes.pin_length_class``), the same on every rank.

Pinned on a small model: ``tests/test_pass_goldens.py::test_detect_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import logging
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from ulysses_compile.compat import recompute_region
from ulysses_compile.errors import DivisibilityError, UnsupportedError
from ulysses_compile.ops import CASTS, spellings
from ulysses_compile.random_draws import value_at_compile
from ulysses_compile.report import module_path
from ulysses_compile.runtime import attention_output, flash_attention, flash_attention_varlen
from ulysses_compile.sharding import block_sizes
from ulysses_compile.sizes import is_symbolic, pin_length_class, same_size


log = logging.getLogger("ulysses_compile")

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


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
    form: str
    module: str
    query: fx.Node
    key: fx.Node
    value: fx.Node
    mask: fx.Node | None
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
    scores: fx.Node | None = None  # hand-written attention: the q @ k^T node (``node`` is probs @ v)
    side_inputs: tuple = ()  # what else the scores are combined with (masks, biases): kept whole
    # Where q, k, v (and an SDPA mask or flash-attn's ALiBi slopes) enter the site: role -> Slot.
    slots: dict[str, Slot] = field(default_factory=dict)
    output_marker: fx.Node | None = None  # hand-written attention: its ``attention_output`` marker
    # Hand-written attention's nodes that run on this rank's heads: node -> (its head dim, the head dim
    # of inputs whose layout differs from its own).
    region: dict = field(default_factory=dict)

    decision: str = ""  # what the rewrite does at this world size

    def entering(self, role: str) -> fx.Node:
        """The value that enters the site as ``role`` ("query", "key", "value", "attn_mask", ...)."""
        return self.slots[role].read()

    def mask_inputs(self) -> tuple:
        return self.side_inputs + ((self.mask,) if isinstance(self.mask, fx.Node) else ())

    def kv_by_all_to_all(self, world_size: int) -> bool:
        """Whether KV heads split over the ranks exactly like the query heads that use them (else each
        rank gathers the KV heads its query heads need)."""
        return self.kv_heads == self.heads or (self.heads % world_size == 0 and self.kv_heads % world_size == 0)

    def layout(self) -> str:
        ndim = _value(self.query).dim()
        names = ["B"] * ndim
        names[self.head_axis], names[self.seq_axis], names[-1] = "H", "S", "D"
        if ndim == 3 and self.head_axis == 0:
            names[0] = "B*H"  # bmm on heads merged into the batch
        return "[" + ", ".join(names) + "]"

    def mask_kind(self) -> str:
        kinds = ["causal"] if self.is_causal else []
        flash = self.form.startswith("flash_attn")
        if flash and self.node.kwargs["window_size"] != (-1, -1):
            kinds.append(f"window {self.node.kwargs['window_size']}")
        if self.form == "flash_attn_varlen":
            kinds.append(f"packed sequences (cu_seqlens {list(_value(self.side_inputs[0]).shape)})")
        for mask in (self.mask,) if flash else (*self.side_inputs, self.mask):
            value = _value(mask) if isinstance(mask, fx.Node) else None
            if isinstance(value, torch.Tensor):
                kind = "alibi" if flash else "bool" if value.dtype == torch.bool else "additive"
                kinds.append(f"{kind} {list(value.shape)}")
        return ", ".join(kinds) or "none"

    def summary(self) -> str:
        kv = f" (kv {self.kv_heads}{f', repeated x{self.kv_repeat} in the model' if self.kv_repeat > 1 else ''})"
        seq = f"{self.seq_len}" + ("" if same_size(self.kv_seq_len, self.seq_len) else f" -> {self.kv_seq_len}")
        return (
            f"{self.module or self.node.name}: {self.form} {self.layout()}, heads {self.heads}{kv}, "
            f"head_dim {self.head_dim}, seq {seq}, mask {self.mask_kind()}; {self.decision}"
        )


def _decide(site: AttentionSite, world_size: int) -> str:
    heads = ",".join(str(size) for size in block_sizes(site.heads, world_size))
    kv = "by all-to-all" if site.kv_by_all_to_all(world_size) else "gathered per query head"
    checkpointed = ", in a checkpointed region (recomputed in the backward)" if recompute_region(site.node) is not None else ""
    return f"parallelized: heads per rank {heads}, key/value {kv}{checkpointed}"


def sdpa_arguments(node: fx.Node) -> dict:
    bound = dict(zip(SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def _value(node) -> torch.Tensor:
    return node.meta["example_value"]


@dataclass(frozen=True)
class Detection:
    sites: list[AttentionSite]
    rejected: list[str]  # "module: why this softmax or SDPA is not parallelized"


def detect_attention(gm: fx.GraphModule, ctx) -> Detection:
    sites, rejected = [], []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in SDPA_TARGETS:
            site = _sdpa_site(node)
        elif node.op == "call_function" and node.target in (flash_attention, flash_attention_varlen):
            site = _flash_site(node)
        elif _is(node, SOFTMAX):
            site = _handwritten_site(node)
            if isinstance(site, AttentionSite):
                site = replace(site, output_marker=_mark_output(gm.graph, site))
        else:
            continue
        if not isinstance(site, AttentionSite):
            if site is not None:
                rejected.append(f"{module_path(node) or node.name}: {site}")
                log.debug("ulysses_compile: not attention at %s: %s", node.name, site)
            continue
        _check_heads(site, ctx.world_size)
        pin_length_class(site.seq_len, ctx.world_size)
        pin_length_class(site.kv_seq_len, ctx.world_size)
        site = replace(site, decision=_decide(site, ctx.world_size))
        log.debug("ulysses_compile: attention %s", site.summary())
        sites.append(site)
    return Detection(sites, rejected)


SOFTMAX = spellings("softmax")
MATMUL = spellings("matmul", "bmm")
SCORES = MATMUL + spellings("baddbmm", "einsum")
VALUES = MATMUL + spellings("einsum")
# Ops that may stand between q @ k^T, the softmax and @ v: scaling, masks, logit soft-capping (Gemma 2's
# cap * tanh(scores / cap)), casts, dropout.
BETWEEN = (*spellings("mul", "div", "add", "sub", "masked_fill", "tanh", "contiguous", "dropout"), *CASTS)


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def _mark_output(graph: fx.Graph, site: "AttentionSite") -> fx.Node:
    node = site.node
    with graph.inserting_after(node):
        marker = graph.call_function(attention_output, (node, site.head_axis, site.seq_axis))
    marker.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "stack_trace", "nn_module_stack")})
    node.replace_all_uses_with(marker, delete_user_cb=lambda user: user is not marker)
    return marker


def _scores_matmul(node, side_inputs: list, depth: int = 0):
    """The q @ k^T node that ``node`` (a softmax input) is computed from, through scales, masks and
    joined sink columns; the other tensors met on the way (masks, biases, sinks) are appended to
    ``side_inputs``."""
    if _is(node, SCORES):
        return node
    joins = _joins_key_columns(node)
    if depth > 6 or not (joins or _is(node, BETWEEN)):
        return None
    found = None
    for arg in _tensors_joined(node) if joins else node.args:
        if found is None and isinstance(arg, fx.Node):
            found = _scores_matmul(arg, side_inputs, depth + 1)
            if found is not None:
                continue
        if isinstance(arg, fx.Node):
            side_inputs.append(arg)
    return found


def _computed_from(node: fx.Node, source: fx.Node, depth: int = 8) -> bool:
    return node is source or depth > 0 and any(_computed_from(arg, source, depth - 1) for arg in node.all_input_nodes)


def _joins_key_columns(node) -> bool:
    """``torch.cat([scores, sinks], dim=-1)``: per-head sink logits joined as extra key columns (gpt-oss)."""
    if not _is(node, (torch.cat, torch.concat)) or not isinstance(_tensors_joined(node), (tuple, list)):
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return isinstance(dim, int) and dim % _value(node).dim() == _value(node).dim() - 1


def _tensors_joined(node):
    return node.args[0] if node.args else node.kwargs.get("tensors")


def _drops_key_columns(node) -> bool:
    """``probs[..., :-1]``: the sink columns dropped again after the softmax."""
    if not _is(node, (operator.getitem,)) or not isinstance(node.args[1], tuple):
        return False
    *leading, last = node.args[1]
    whole = all(index is Ellipsis or index == slice(None) for index in leading)
    return whole and Ellipsis in leading and isinstance(last, slice) and last.start is None and last.step is None


def _values_matmul(node, depth: int = 0):
    """The probs @ v node that consumes a softmax result (through casts and dropout), and the probs."""
    for user in node.users:
        if _is(user, VALUES) and _probs_operand(user) is node:
            return user
        if depth < 4 and (_is(user, BETWEEN) or _drops_key_columns(user)) and user.args[0] is node:
            found = _values_matmul(user, depth + 1)
            if found is not None:
                return found
    return None


def _unread_attention(softmax: fx.Node) -> str | None:
    """A softmax between two products that the forms above do not read (a reshape or an op between
    them): why it runs replicated, or None when it is no such softmax (a router, a classifier)."""
    before = _ops_to_product(softmax.args[0], lambda node: node.all_input_nodes, SCORES)
    after = _ops_to_product(softmax, lambda node: list(node.users), VALUES)
    if before is None or after is None:
        return None
    unread = sorted(op for op in (before | after) - _op_names([softmax]) if not _is_named(op, BETWEEN))
    return (f"a softmax between two products, but not read as attention: {', '.join(unread) or 'its layout'} "
            f"between them (heads merged with the batch, a reshape, or an op the recognizer does not know)")


def _ops_to_product(node, neighbours, products, depth: int = 5) -> set[str] | None:
    """The names of the ops on a short path from ``node`` to a product, or None when none is near."""
    if _is(node, products):
        return set()
    if depth == 0 or not isinstance(node, fx.Node):
        return None
    for neighbour in neighbours(node):
        found = _ops_to_product(neighbour, neighbours, products, depth - 1)
        if found is not None:
            return found | _op_names([node]) if node.op in ("call_function", "call_method") else found
    return None


def _is_named(name: str, targets) -> bool:
    return any(getattr(target, "__name__", target) == name for target in targets)


def _op_names(nodes) -> set[str]:
    return {getattr(node.target, "__name__", str(node.target)) for node in nodes}


def _probs_operand(node):
    return node.args[1] if node.target is torch.einsum else node.args[0]


def _transposed_last_dims(node):
    """``k`` when ``node`` is ``k.transpose(-2, -1)`` (or ``swapaxes``; any spelling of the last two dims),
    else None."""
    if not _is(node, spellings("transpose", "swapaxes", "swapdims")) or len(node.args) < 3:
        return None
    source = node.args[0]
    ndim = _value(source).dim()
    return source if {d % ndim for d in node.args[1:3]} == {ndim - 2, ndim - 1} else None


@dataclass
class _Operands:
    """One matmul-like node of a hand-written attention, read as attention: its two operands, where
    each enters the node, and the dims (head, sequence) of each tensor involved."""

    first: fx.Node
    second: fx.Node
    slots: dict[str, Slot]  # "first", "second"
    axes: dict  # "first"/"second"/"out" -> (head axis, sequence axis)
    form: str


def _einsum_operands(node, role: str) -> "_Operands | str":
    """``einsum("bhqd,bhkd->bhqk", q, k)`` (scores) or ``einsum("bhqk,bhkd->bhqd", p, v)`` (values):
    the letters tell which dims are heads, query and key positions, in any layout."""
    if len(node.args) != 3 or not isinstance(node.args[0], str) or "..." in node.args[0]:
        return "einsum with other than two operands spelled out"
    inputs, _, out = node.args[0].replace(" ", "").partition("->")
    left, right = inputs.split(",")
    batch = [c for c in left if c in right and c in out]
    if not batch:
        return f"einsum {node.args[0]!r} has no head dim shared by both operands and the result"
    head = batch[-1]  # heads come after batch in [B, H, S, D] and [B, S, H, D]
    left_only = [c for c in left if c not in right]
    right_only = [c for c in right if c not in left]
    contracted = [c for c in left if c in right and c not in out]
    if len(left_only) != 1 or len(right_only) != 1 or len(contracted) != 1:
        return f"einsum {node.args[0]!r} is not one attention product"
    if role == "scores":  # q: (head, query), k: (head, key), scores: (head, key) for the softmax dim
        query, key = left_only[0], right_only[0]
        axes = {"first": (left.index(head), left.index(query)), "second": (right.index(head), right.index(key)),
                "out": (out.index(head), out.index(key))}
    else:  # probs: (head, key), v: (head, key), out: (head, query)
        key = contracted[0]
        axes = {"first": (left.index(head), left.index(key)), "second": (right.index(head), right.index(key)),
                "out": (out.index(head), out.index(left_only[0]))}
    return _Operands(node.args[1], node.args[2], {"first": Slot(node, 1), "second": Slot(node, 2)}, axes, "einsum")


def _matmul_operands(node, role: str) -> "_Operands | str":
    """``q @ k.transpose(-2, -1)`` / ``bmm`` / ``baddbmm(bias, q, k^T)`` and ``probs @ v``, on
    ``[.., heads, seq, dim]`` (with bmm, ``[batch * heads, seq, dim]``)."""
    first_at = 1 if node.target in (torch.baddbmm, "baddbmm") else 0
    # bias.baddbmm(batch1=q, batch2=k^T), as Bloom writes it, and any mix of positions and keywords
    slots = {role: Slot(node, at) if len(node.args) > at else Slot(node, keyword)
             for role, at, keyword in (("first", first_at, "batch1"), ("second", first_at + 1, "batch2"))}
    if any(isinstance(slot.argument, str) and slot.argument not in node.kwargs for slot in slots.values()):
        return "a product whose operands are not both given"
    first, second = slots["first"].read(), slots["second"].read()
    if role == "scores":
        key = _transposed_last_dims(second)
        if key is None:
            return "the second operand of q @ k^T is not k transposed in its last two dims"
        slots["second"] = Slot(second, 0)
        second = key
    ndim = _value(first).dim() if isinstance(first, fx.Node) else 0
    if ndim < 3 or not isinstance(second, fx.Node) or _value(second).dim() != ndim:
        return "q, k and v are not [.., heads, seq, head_dim] tensors of one rank"
    axes = {"first": (ndim - 3, ndim - 2), "second": (ndim - 3, ndim - 2),
            "out": (ndim - 3, ndim - 1 if role == "scores" else ndim - 2)}
    form = "baddbmm" if node.target in (torch.baddbmm, "baddbmm") else "bmm" if node.target in (torch.bmm, "bmm") \
        else "matmul"
    return _Operands(first, second, slots, axes, form)


def _operands(node, role: str) -> "_Operands | str":
    return _einsum_operands(node, role) if node.target is torch.einsum else _matmul_operands(node, role)


def _handwritten_site(softmax: fx.Node) -> "AttentionSite | str | None":
    """``softmax(q @ k^T * scale [+ mask]) [dropout] @ v``, the products written with matmul, bmm,
    baddbmm or einsum. None when the softmax is not between two products (no candidate); a reason
    when it is but cannot be read as attention."""
    out = _value(softmax)
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    side_inputs: list[fx.Node] = []
    scores_node, values_node = _scores_matmul(softmax.args[0], side_inputs), _values_matmul(softmax)
    # A max subtracted for stability is computed from the scores: not a mask or bias entering the site.
    side_inputs = [arg for arg in side_inputs if scores_node is None or not _computed_from(arg, scores_node)]
    if scores_node is not None and values_node is None:
        return ("a softmax of q @ k^T whose probabilities reach no @ v through scaling, masks, casts or dropout: "
                f"read by {', '.join(sorted(_op_names(softmax.users)))}")
    if scores_node is None:
        return _unread_attention(softmax)
    if not isinstance(out, torch.Tensor) or dim is None:
        return None
    scores, values = _operands(scores_node, "scores"), _operands(values_node, "values")
    for found in (scores, values):
        if isinstance(found, str):
            return found
    if dim % out.dim() - out.dim() != scores.axes["out"][1] - _value(scores_node).dim():
        return f"the softmax runs over dim {dim}, not over the key positions (dim {scores.axes['out'][1]})"
    query, key, value = scores.first, scores.second, values.second
    layouts = {scores.axes["first"], scores.axes["second"], values.axes["second"], values.axes["out"]}
    if len(layouts) != 1:
        return "q, k, v and the output do not share one layout of heads and sequence"
    (head_axis, seq_axis), = layouts
    q, k, v = _value(query), _value(key), _value(value)
    if not (q.dim() == k.dim() == v.dim() and q.shape[head_axis] == k.shape[head_axis] == v.shape[head_axis]):
        return "q, k and v have different numbers of heads"
    probs = values.first
    if scores.form == "baddbmm":
        side_inputs.append(scores_node.args[0] if scores_node.args else scores_node.kwargs["input"])
    region = {scores.slots["second"].consumer: (head_axis, {}), scores_node: (scores.axes["out"][0], {}),
              values_node: (head_axis, {probs: values.axes["first"][0]})}
    slots = {"query": scores.slots["first"], "key": scores.slots["second"], "value": values.slots["second"]}
    form = f"{scores.form}_softmax" + ("" if values.form == scores.form else f"_{values.form}")
    return _site(values_node, form, module_path(softmax), query, key, value, mask=None,
                 is_causal=False, scores=scores_node, side_inputs=tuple(side_inputs), slots=slots,
                 region=region, head_axis=head_axis, seq_axis=seq_axis)


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


def _sdpa_site(node: fx.Node) -> AttentionSite:
    args = sdpa_arguments(node)
    q = _value(args["query"])
    if q.dim() < 3:
        return (f"scaled_dot_product_attention on a query of shape {list(q.shape)} has no head dim to split "
                f"over the ranks (expected [..., heads, sequence, head_dim]); it runs whole on every rank")
    slots = {}
    for name in ("query", "key", "value", "attn_mask"):
        if SDPA_PARAMS.index(name) < len(node.args):
            slots[name] = Slot(node, SDPA_PARAMS.index(name))
        elif name in node.kwargs:
            slots[name] = Slot(node, name)
    return _site(node, "scaled_dot_product_attention", module_path(node), args["query"], args["key"],
                 args["value"], mask=args.get("attn_mask"), is_causal=bool(args.get("is_causal", False)), slots=slots)


def _flash_site(node: fx.Node) -> AttentionSite:
    """flash-attn on ``[B, S, H, D]``, or varlen on packed ``[total, H, D]``; KV may have fewer heads
    (flash-attn's own MQA/GQA)."""
    if (dropout := _kernel_dropout(node.kwargs["dropout_p"])) is not None:
        return dropout
    slots = {"query": Slot(node, 0), "key": Slot(node, 1), "value": Slot(node, 2)}
    if isinstance(node.kwargs.get("alibi_slopes"), fx.Node):
        slots["alibi_slopes"] = Slot(node, "alibi_slopes")
    query, key, value = node.args[:3]
    packed = node.target is flash_attention_varlen
    return _site(node, "flash_attn_varlen" if packed else "flash_attn", module_path(node), query, key, value,
                 mask=node.kwargs.get("alibi_slopes"), is_causal=node.kwargs["causal"], slots=slots,
                 head_axis=1 if packed else 2, seq_axis=0 if packed else 1,
                 side_inputs=tuple(node.args[3:5]) if packed else ())


def _site(node, form, module, query, key, value, head_axis=None, seq_axis=None, **details) -> AttentionSite:
    """A site with its sizes read off q and k (by default ``[.., heads, seq, head_dim]``), and any KV
    repeat."""
    q, k = _value(query), _value(key)
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
        node=node,
        form=form,
        module=module,
        query=query,
        key=key,
        value=value,
        heads=q.shape[head_axis],
        kv_heads=k.shape[head_axis],
        head_dim=q.shape[-1],
        seq_len=q.shape[seq_axis],
        kv_seq_len=k.shape[seq_axis],
        head_axis=head_axis,
        seq_axis=seq_axis,
        **details,
    )
    return _with_kv_repeat(site)


def _with_kv_repeat(site: AttentionSite) -> AttentionSite:
    """Record a repeat of KV heads written in front of the attention (both key and value repeated)."""
    key_source, key_repeat = unrepeated_heads(site.key, site.head_axis)
    value_source, value_repeat = unrepeated_heads(site.value, site.head_axis)
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
        if isinstance(repeats, int) and dim is not None and dim % _value(source).dim() == head_axis:
            return source, repeats
        return node, 1
    if node.op != "call_method" or node.target not in ("reshape", "view"):
        return node, 1
    expanded = node.args[0]
    if not isinstance(expanded, fx.Node) or expanded.op != "call_method" or expanded.target != "expand":
        return node, 1
    unsqueezed = expanded.args[0]
    source = unsqueezed.args[0] if isinstance(unsqueezed, fx.Node) and unsqueezed.args else None
    if not isinstance(source, fx.Node) or not isinstance(_value(source), torch.Tensor):
        return node, 1
    src, big, out = _value(source), _value(expanded), _value(node)
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


def _check_heads(site: AttentionSite, world_size: int) -> None:
    """Heads and sequences split over the ranks in balanced blocks, so any count works as long as every
    rank gets a head; key/value heads that do not split like the query heads are gathered."""
    where = f"attention {site.module or site.node.name} ({site.form})"
    if site.heads < world_size:
        raise DivisibilityError(
            f"{where}: {site.heads} query heads cannot be split over {world_size} sequence-parallel ranks; "
            f"Ulysses gives each rank at least one whole head. Use at most {site.heads} ranks for sequence "
            f"parallelism (with a mesh, put the other ranks on a \"dp\" dim), or a model with at least "
            f"{world_size} heads"
        )
