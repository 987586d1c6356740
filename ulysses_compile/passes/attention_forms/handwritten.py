"""Attention written by hand: ``softmax(q @ k^T * scale [+ mask]) [dropout] @ v``, the products written
with ``matmul``/``@``, ``bmm``, ``baddbmm`` (bias and scale inside) or ``einsum`` in any layout, through
scales, masks, casts, dropout, joined sink columns and views that regroup heads merged with the batch
(Bloom's ``[B*H, S, S]`` viewed as ``[B, H, S, S]`` for the mask and back: each batch's heads then
split over the ranks, ``AttentionSite.heads_outer``). The form reads the softmax; the site's nodes from
``q @ k^T`` to ``@ v`` run on the rank's heads (its ``region``, placed by propagation), and its result
passes through ``attention_output``, an identity marking where the heads end, which becomes the
all-to-all back to the sequence; a scaling of ``@ v``'s result by a value computed from the scores
(Granite's sinks) runs on the heads too, the marker after it. Masks and biases it meets are kept whole.

Where the site must run as a ring (more ranks than heads, ranks on several nodes), attention written
as ``softmax(q @ k^T * scale + masks) @ v`` on ``[B, H, S, D]`` (through casts and a dropout that drops
nothing: Llama's, Qwen's, Mistral's eager attention; a ``masked_fill(cond, -inf)`` in place of the
masks, as nanoGPT's) is put in the graph as the one ``scaled_dot_product_attention(q, k, v,
attn_mask=mask, scale=scale)`` it computes, and runs as that call's ring (``as_ring_site``); other
spellings (soft-capping, clamps, sinks, merged heads, attention weights read elsewhere, a scaling after
a mask, masks of another dtype) keep Ulysses where the heads allow, with the reason."""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.fx as fx

from ulysses_compile.core.fx_graph import erase_unused, fill_example_values, method_or_function_args, permute_dims
from ulysses_compile.core.ops import CASTS, spellings
from ulysses_compile.core.report import module_path
from ulysses_compile.core.runtime import attention_output
from ulysses_compile.core.sharding import Shard, seq_shard
from ulysses_compile.passes.attention_forms import FORMS, AttentionForm, AttentionSite, Slot, read_site, value_of
from ulysses_compile.passes.attention_forms.sdpa import SDPA, ring_inputs_blocker
from ulysses_compile.passes.rules import Decision, register
from ulysses_compile.passes.rules.pointwise import DROPOUT_PARAMS

SOFTMAX = spellings("softmax")
MATMUL = spellings("matmul", "bmm")
SCORES = MATMUL + spellings("baddbmm", "einsum")
VALUES = MATMUL + spellings("einsum")
# Ops that may stand between q @ k^T, the softmax and @ v: scaling, masks, logit soft-capping (Gemma 2's
# cap * tanh(scores / cap)), casts, dropout.
BETWEEN = (*spellings("mul", "div", "add", "sub", "multiply", "divide", "subtract", "masked_fill", "where", "tanh",
                     "contiguous", "dropout"), *CASTS)
VIEWS = spellings("view", "reshape")
EXTREMA = spellings("max", "min")  # torch.max(scores, floor) is elementwise with a tensor second operand


def _between(node) -> bool:
    """An op that may stand between the products (``BETWEEN``, or an elementwise max/min: XGLM clamps
    the masked scores with ``torch.max(scores, finfo.min)``)."""
    return _is(node, BETWEEN) or _is(node, EXTREMA) and len(node.args) == 2 and isinstance(node.args[1], fx.Node)


def _regroups_heads(node) -> bool:
    """A view between the products that only regroups the dims before the (query, key) dims: Bloom's
    ``[B*H, S, S]`` to ``[B, H, S, S]`` for the mask and the softmax, and back for ``bmm``."""
    if not _is(node, VIEWS) or not isinstance(node.args[0], fx.Node):
        return False
    before, after = value_of(node.args[0]), value_of(node)
    return before.dim() >= 3 and after.dim() >= 3 and before.shape[-2:] == after.shape[-2:]


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def _mark_output(site: AttentionSite) -> fx.Node:
    """The site's result passed through ``attention_output``, which marks where its heads end."""
    node = site.node
    with node.graph.inserting_after(node):
        marker = node.graph.call_function(attention_output, (node, site.head_axis, site.seq_axis,
                                                             *site.merged_heads_args()))
    marker.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "stack_trace", "nn_module_stack")})
    node.replace_all_uses_with(marker, delete_user_cb=lambda user: user is not marker)
    return marker


def _scores_matmul(node, side_inputs: list, views: list, depth: int = 0):
    """The q @ k^T node that ``node`` (a softmax input) is computed from, through scales, masks,
    joined sink columns and views regrouping the heads; the other tensors met on the way (masks, biases,
    sinks) are appended to ``side_inputs``, the views to ``views``."""
    if _is(node, SCORES):
        return node
    joins = _joins_key_columns(node)
    if depth > 6 or not (joins or _between(node) or _regroups_heads(node)):
        return None
    found = None
    for arg in _tensors_joined(node) if joins else node.args[:1] if _regroups_heads(node) else node.args:
        if found is None and isinstance(arg, fx.Node):
            found = _scores_matmul(arg, side_inputs, views, depth + 1)
            if found is not None:
                continue
        if isinstance(arg, fx.Node):
            side_inputs.append(arg)
    if found is not None and _regroups_heads(node):
        views.append(node)
    return found


def _computed_from(node: fx.Node, source: fx.Node, depth: int = 8) -> bool:
    return node is source or depth > 0 and any(_computed_from(arg, source, depth - 1) for arg in node.all_input_nodes)


def _joins_key_columns(node) -> bool:
    """``torch.cat([scores, sinks], dim=-1)``: per-head sink logits joined as extra key columns (gpt-oss)."""
    if not _is(node, spellings("cat", "concat", "concatenate")) or not isinstance(_tensors_joined(node), (tuple, list)):
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return isinstance(dim, int) and dim % value_of(node).dim() == value_of(node).dim() - 1


def _tensors_joined(node):
    return node.args[0] if node.args else node.kwargs.get("tensors")


def _drops_key_columns(node) -> bool:
    """``probs[..., :-1]``: the sink columns dropped again after the softmax."""
    if not _is(node, (operator.getitem,)) or not isinstance(node.args[1], tuple):
        return False
    *leading, last = node.args[1]
    whole = all(index is Ellipsis or index == slice(None) for index in leading)
    return whole and Ellipsis in leading and isinstance(last, slice) and last.start is None and last.step is None


def _values_matmul(node, views: list, depth: int = 0):
    """The probs @ v node that consumes a softmax result (through casts, dropout and views regrouping
    the heads, appended to ``views``)."""
    for user in node.users:
        if _is(user, VALUES) and _probs_operand(user) is node:
            return user
        if depth < 5 and (_between(user) or _drops_key_columns(user) or _regroups_heads(user)) \
                and user.args[0] is node:
            found = _values_matmul(user, views, depth + 1)
            if found is not None:
                views.extend([user] if _regroups_heads(user) else [])
                return found
    return None


def _scaled_by_the_scores(output: fx.Node, scores: fx.Node) -> fx.Node | None:
    """The product's only reader when it scales it by a value computed from the scores, per head and
    query: Granite's sink, ``out * sigmoid(logsumexp(scores) - sinks).unsqueeze(-1)``, runs on the
    rank's heads with the attention; else None."""
    if len(output.users) != 1:
        return None
    (user,) = output.users
    if not _is(user, spellings("mul", "div")) or user.args[0] is not output or len(user.args) != 2 \
            or not isinstance(user.args[1], fx.Node) or value_of(user).shape != value_of(output).shape \
            or not _computed_from(user.args[1], scores, depth=12):
        return None
    return user


def _heads_outer(views: list, q_heads: int, head_axis: int, ndim: int) -> "int | str":
    """The batch merged before the heads in q's head dim, read off the views between the products
    (``[B*H, S, S]`` <-> ``[B, H, S, S]``): 1 without such views, a reason where they regroup otherwise."""
    if not views:
        return 1
    heads = set()
    for view in views:
        merged, apart = sorted((value_of(view.args[0]), value_of(view)), key=lambda value: value.dim())
        if merged.dim() != ndim or head_axis != ndim - 3 or merged.dim() + 1 != apart.dim() \
                or merged.shape[-3] != q_heads or apart.shape[-4] * apart.shape[-3] != q_heads:
            return (f"a view between the products regroups {list(merged.shape)} as {list(apart.shape)}, not the "
                    f"heads merged in q's dim {head_axis} ({q_heads}) as a batch and heads")
        heads.add(apart.shape[-3])
    if len(heads) != 1:
        return f"the views between the products split the merged heads as {sorted(heads)} heads"
    return q_heads // heads.pop()


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
    """``k`` when ``node`` is k with its last two dims swapped: ``k.transpose(-2, -1)`` (or ``swapaxes``,
    ``swapdims``; any spelling of the dims), ``k.mT``, ``k.permute(0, 1, 3, 2)``; else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node) \
            or not isinstance(node.args[0].meta.get("example_value"), torch.Tensor):
        return None
    source = node.args[0]
    ndim = value_of(source).dim()
    if node.op == "call_function" and node.target is getattr:
        return source if node.args[1] == "mT" else None
    if _is(node, spellings("permute")):
        return source if [d % ndim for d in permute_dims(node)] == [*range(ndim - 2), ndim - 1, ndim - 2] else None
    if not _is(node, spellings("transpose", "swapaxes", "swapdims")) or len(node.args) < 3:
        return None
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
    ndim = value_of(first).dim() if isinstance(first, fx.Node) else 0
    if ndim < 3 or not isinstance(second, fx.Node) or value_of(second).dim() != ndim:
        return "q, k and v are not [.., heads, seq, head_dim] tensors of one rank"
    axes = {"first": (ndim - 3, ndim - 2), "second": (ndim - 3, ndim - 2),
            "out": (ndim - 3, ndim - 1 if role == "scores" else ndim - 2)}
    form = "baddbmm" if node.target in (torch.baddbmm, "baddbmm") else "bmm" if node.target in (torch.bmm, "bmm") \
        else "matmul"
    return _Operands(first, second, slots, axes, form)


def _operands(node, role: str) -> "_Operands | str":
    return _einsum_operands(node, role) if node.target is torch.einsum else _matmul_operands(node, role)


def _read(softmax: fx.Node) -> "AttentionSite | str | None":
    """``softmax(q @ k^T * scale [+ mask]) [dropout] @ v``, the products written with matmul, bmm,
    baddbmm or einsum. None when the softmax is not between two products (no candidate); a reason
    when it is but cannot be read as attention."""
    out = value_of(softmax)
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    side_inputs: list[fx.Node] = []
    views: list[fx.Node] = []
    scores_node, values_node = _scores_matmul(softmax.args[0], side_inputs, views), _values_matmul(softmax, views)
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
    if dim % out.dim() - out.dim() != scores.axes["out"][1] - value_of(scores_node).dim():
        return f"the softmax runs over dim {dim}, not over the key positions (dim {scores.axes['out'][1]})"
    query, key, value = scores.first, scores.second, values.second
    layouts = {scores.axes["first"], scores.axes["second"], values.axes["second"], values.axes["out"]}
    if len(layouts) != 1:
        return "q, k, v and the output do not share one layout of heads and sequence"
    (head_axis, seq_axis), = layouts
    q, k, v = value_of(query), value_of(key), value_of(value)
    if not (q.dim() == k.dim() == v.dim() and q.shape[head_axis] == k.shape[head_axis] == v.shape[head_axis]):
        return "q, k and v have different numbers of heads"
    heads_outer = _heads_outer(views, q.shape[head_axis], head_axis, q.dim())
    if isinstance(heads_outer, str):
        return heads_outer
    probs = values.first
    if scores.form == "baddbmm":
        side_inputs.append(scores_node.args[0] if scores_node.args else scores_node.kwargs["input"])
    region = {scores.slots["second"].consumer: (head_axis, {}), scores_node: (scores.axes["out"][0], {}),
              values_node: (head_axis, {probs: values.axes["first"][0]})}
    output = values_node
    while (scaled := _scaled_by_the_scores(output, scores_node)) is not None:
        region[scaled] = (head_axis, {})
        output = scaled
    slots = {"query": scores.slots["first"], "key": scores.slots["second"], "value": values.slots["second"]}
    spelling = f"{scores.form}_softmax" + ("" if values.form == scores.form else f"_{values.form}")
    site = read_site(output, HANDWRITTEN, spelling, module_path(softmax), slots, head_axis=head_axis,
                     seq_axis=seq_axis, is_causal=False, scores=scores_node, side_inputs=tuple(side_inputs),
                     region=region, heads_outer=heads_outer)
    if heads_outer > 1:
        if site.kv_heads != site.heads or site.kv_repeat > 1:
            return ("heads merged with the batch (the views between the products) with fewer key/value heads "
                    "than query heads: their KV heads would be gathered per query head, which is not built for "
                    "merged heads")
        site = replace(site, heads=site.heads // heads_outer, kv_heads=site.kv_heads // heads_outer)
    return replace(site, output_marker=_mark_output(site))


class _SdpaTerms(NamedTuple):
    scale: float
    masks: list[fx.Node]  # added to the scaled scores
    hidden: list[fx.Node]  # conditions whose positions are filled with -inf


def _sdpa_terms(site: AttentionSite) -> "_SdpaTerms | str":
    """The terms of a site written as ``softmax((q @ k^T * scale + masks).masked_fill(hidden, -inf)) @ v``
    on ``[B, H, S, D]`` (casts and a dropout that drops nothing between; q, k, v and the masks of one
    dtype, none written in place), which is ``scaled_dot_product_attention``; or why it is not that."""
    scores, output = site.scores, site.node
    if not (_is(scores, MATMUL) and _is(output, MATMUL)) or site.heads_outer > 1 or value_of(scores).dim() != 4:
        return f"{site.spelling} on {site.layout()}: only q @ k^T and @ v on [B, H, S, D] run as one attention call"
    scale, masks, hidden, node = 1.0, [], [], scores
    while not _is(node, SOFTMAX):
        previous, node = node, _only_reader(node)
        if isinstance(node, str):
            return node
        factor = _scale_factor(node, previous)
        filled = method_or_function_args(node, ("input", "mask", "value")) if _is(node, spellings("masked_fill")) \
            else None
        if factor is not None:
            if masks or hidden:
                return "a scaling after a mask (one attention call scales the scores before it adds its mask)"
            scale *= factor
        elif _is(node, spellings("add")) and not node.kwargs and len(node.args) == 2 and previous in node.args \
                and isinstance(other := node.args[node.args[0] is previous], fx.Node) and other is not previous:
            masks.append(other)
        elif filled is not None and filled["input"] is previous and isinstance(filled["mask"], fx.Node) \
                and filled["value"] == float("-inf"):
            hidden.append(filled["mask"])
        elif not _is(node, (*CASTS, *spellings("contiguous"), *SOFTMAX)):
            return (f"{_op_names([node]).pop()} between q @ k^T and the softmax (a ring runs scaling, additive masks "
                    f"and casts)")
    while node is not output:
        previous, node = node, _only_reader(node)
        if isinstance(node, str):
            return node
        dropout = method_or_function_args(node, DROPOUT_PARAMS, {"p": 0.5, "training": True}) \
            if _is(node, spellings("dropout")) else None
        if node is output:
            if _probs_operand(node) is not previous:
                return "the probabilities are not the first operand of @ v"
        elif dropout is not None and dropout["p"] != 0 and dropout["training"]:
            return "its dropout (p > 0 in training) is not drawn per block of a ring"
        elif dropout is None and not _is(node, (*CASTS, *spellings("contiguous"))):
            return f"{_op_names([node]).pop()} between the softmax and @ v"
    return _checked_terms(site, _SdpaTerms(scale, masks, hidden))


def _scale_factor(node: fx.Node, scores: fx.Node) -> float | None:
    """The number ``node`` multiplies ``scores`` by (``scores * c``, ``c * scores``, ``scores / c``), or None."""
    if node.kwargs or len(node.args) != 2:
        return None
    if _is(node, spellings("mul")) and scores in node.args:
        factor = node.args[node.args[0] is scores]
        return factor if isinstance(factor, (int, float)) and not isinstance(factor, bool) else None
    if _is(node, spellings("div")) and node.args[0] is scores and isinstance(node.args[1], (int, float)) \
            and not isinstance(node.args[1], bool) and node.args[1] != 0:
        return 1 / node.args[1]
    return None


def _checked_terms(site: AttentionSite, terms: _SdpaTerms) -> "_SdpaTerms | str":
    """``terms``, where q, k, v and the additive masks share a dtype, the fills are boolean and none of
    them is written in place (the call reads them where ``@ v`` was); else why not."""
    from ulysses_compile.passes.in_place_writes import alias_bases, written_bases  # in_place_writes reads the rules

    inputs = [site.entering(role) for role in ("query", "key", "value")]
    dtype = value_of(inputs[0]).dtype
    if any(value_of(node).dtype != dtype for node in inputs):
        return "q, k and v of different dtypes (one attention call takes one)"
    if any(value_of(mask).dtype != dtype for mask in terms.masks):
        return f"an additive mask of another dtype than q's {dtype} (one attention call adds it in q's)"
    if any(value_of(condition).dtype != torch.bool for condition in terms.hidden):
        return "a -inf fill at positions that are not a boolean mask"
    bases = alias_bases(site.node.graph)
    written = written_bases(site.node.graph, bases)
    if any(bases.get(node, node) in written for node in (*inputs, *terms.masks, *terms.hidden)):
        return "q, k, v or a mask written in place (one attention call reads them where @ v is)"
    return terms


def _only_reader(node: fx.Node) -> "fx.Node | str":
    if len(node.users) != 1:
        return (f"{node.name} between q @ k^T and @ v is read by {len(node.users)} ops (one attention call keeps "
                f"nothing between them)")
    return next(iter(node.users))


class HandwrittenAttention(AttentionForm):
    """Read from its softmax. Reading a site also marks its output (``attention_output``), the one change
    to the graph detection makes, unless it runs as a ring (``as_ring_site``)."""

    targets = SOFTMAX

    def read(self, node):
        return _read(node)

    def ring_blocker(self, site, world_size):
        terms = _sdpa_terms(site)
        if isinstance(terms, str):
            return terms
        return ring_inputs_blocker(site, [*terms.masks, *terms.hidden], world_size)

    def as_ring_site(self, site):
        """``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)`` in place of the products
        and what is between them (the mask: the additive masks summed, or the positions no -inf fill
        hides; ``is_causal=True`` and no mask where they keep the causal triangle, proven as
        ``recognize_causal_mask`` proves SDPA's masks), read as an SDPA site."""
        from ulysses_compile.passes.recognize_causal_mask import keeps_the_triangle  # it reads the SDPA form

        terms = _sdpa_terms(site)
        graph, output = site.node.graph, site.node
        query, key, value = (site.entering(role) for role in ("query", "key", "value"))
        causal = bool(terms.masks or terms.hidden) and keeps_the_triangle(terms.masks, terms.hidden, query, key, output)
        before = set(graph.nodes)
        with graph.inserting_before(output):
            mask = None if causal else _one_mask(graph, terms)
            call = graph.call_function(torch._C._nn.scaled_dot_product_attention, (query, key, value),
                                       {"attn_mask": mask, "scale": terms.scale, "is_causal": causal})
        fill_example_values([node for node in graph.nodes if node not in before], output)
        site.output_marker.replace_all_uses_with(call)
        graph.erase_node(site.output_marker)
        erase_unused(output)
        return replace(SDPA.read(call), spelling=f"{site.spelling} as scaled_dot_product_attention")


def _one_mask(graph: fx.Graph, terms: _SdpaTerms) -> fx.Node | None:
    """The one mask of an attention call for ``terms``: the additive masks summed, or the positions no
    -inf fill hides."""
    mask = None
    for each in terms.masks:
        mask = each if mask is None else graph.call_function(operator.add, (mask, each))
    for each in terms.hidden:
        mask = each if mask is None else graph.call_function(operator.or_, (mask, each))
    return graph.call_function(torch.logical_not, (mask,)) if terms.hidden else mask


@register(attention_output)
def attention_output_rule(node, view):
    """A hand-written attention's result leaves its heads for the sequence: insert_all_to_all makes
    this marker the all-to-all."""
    x, head_axis, seq_axis, *merged = node.args
    return Decision(Shard(seq_axis), {x: seq_shard(head_axis, outer=merged[0] if merged else 1)})


HANDWRITTEN = HandwrittenAttention()
FORMS.append(HANDWRITTEN)
