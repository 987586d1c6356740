"""Give every node a placement: sequence sharding flows from the inputs of attention (and of causal
convolutions) to the outputs.

Before::

    emb = F.embedding(input_ids, wte)              # input_ids: [B, S]
    q = linear(emb, wq).view(B, S, H, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

After: the same graph, each node placed (``sharding.place``; shown here as a comment)::

    emb   S(1)   inputs {input_ids: S(1), wte: R}  # input_ids arrives sliced to this rank's tokens
    q     S(2)                                      # view: local shape (B, S/P, H, D) at rewrite
    out   S(2)   inputs {q: S(2), k: S(2), v: S(2)}

Graph inputs are global (every rank passes the same batch), so they start Replicate. Sharding starts
where it pays: at a node on the way to an attention's q/k/v (and not to its mask, which must stay
whole) whose inputs are all replicated, the first non-parameter input is offered sharded along its
sequence dim (found by walking back from the attention, sequence_dims.py); if the op's rule
accepts that, the input will be sliced there (free: no communication). From then on rules decide. A node whose rule has
no sharded answer, or that has no rule, takes its inputs gathered and is recorded as a fallback.

Fallbacks whose whole results meet form a region (a state-space layer's chunked scan). For each size
of a dim that all the inputs a region gathers have besides the sequence (the scan's heads), the graph
is placed again with those inputs offered on that dim instead, and the choice is kept where the graph
then communicates fewer elements: the inputs reach that dim by all-to-all, and an op whose rule refuses
a value held off the sequence takes it back to the sequence the same way. Sharding may so sit on dims
other than the sequence.

Pinned on a small model: ``tests/test_pass_goldens.py::test_propagate_sharding``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ulysses_compile.core.compat import add_batch_dim, vmap_decrement_nesting, vmap_increment_nesting
from ulysses_compile.core.errors import UnsupportedError
from ulysses_compile.core.fx_graph import ancestors, insert_part, method_or_function_args, mutated_arg
from ulysses_compile.core.ops import spellings
from ulysses_compile.core.report import Fallback, module_path
from ulysses_compile.core.runtime import owned_by
from ulysses_compile.core.sharding import (
    REPLICATE,
    PARTIAL,
    NodeSharding,
    Partial,
    PermutedShard,
    Positions,
    Shard,
    completed,
    describe,
    is_permuted,
    is_rank_local,
    is_sharded,
    place,
    seq_shard,
    sharding_of,
    sort_orders,
    with_dim,
)
from ulysses_compile.core.sizes import is_symbolic, same_size, size_hint
from ulysses_compile.passes.in_place_writes import alias_bases, is_gathering_index, may_alias, written_bases
from ulysses_compile.passes.recognize_causal_convolution import causal_convolutions
from ulysses_compile.passes.rules import RuleView, replicate_all, rule_for
from ulysses_compile.passes.redistribute import all_to_all_converts
from ulysses_compile.passes.rules.routing import FRESH_BUFFERS, whole_like
from ulysses_compile.passes.sequence_dims import sequence_dims

LINEAR = spellings("linear")


@dataclass
class Propagation:
    """What placing the graph found."""

    fallbacks: list[Fallback]  # the nodes computed on gathered inputs
    off_sequence: list[str]  # "module: what went to another dim" for each region moved off the sequence
    whole_operands: list[str]  # a line for each input a rule takes whole while the node keeps its rows


def propagate_sharding(gm: fx.GraphModule, ctx, sites: list) -> Propagation:
    """Place every node; returns the nodes computed on gathered inputs and the regions moved off the
    sequence.

    Where ops that run whole on gathered sequences meet (a state-space scan over the sequence), they
    may all keep another dim apart instead (``_moves_off_the_sequence``): their inputs then go there
    by all-to-all, as an attention's q, k and v go to the heads, and the first op that needs the
    sequence again takes its value back to it the same way. Ranks decide alike: placements depend on
    global shapes and P, not on the rank."""
    facts = _GraphFacts.of(gm, ctx, sites)
    moves, placed = _moves_off_the_sequence(gm, ctx, sites, facts, _settle(gm, ctx, facts, {}))
    return Propagation(placed.fallbacks, _describe_moves(moves), placed.whole_operands)


@dataclass
class _GraphFacts:
    """What placing reads of the graph and its sites, not of placements: found once, for every placing
    of the graph (each revisit, each try of ``_moves_off_the_sequence``)."""

    bases: dict[fx.Node, fx.Node]
    writes: list[tuple[fx.Node, fx.Node]]  # (an in-place op, what it writes)
    order: dict[fx.Node, int]
    attention: set[fx.Node]  # the sites and their head-parallel nodes
    site_nodes: set[fx.Node]
    head_parallel: dict[fx.Node, tuple]
    seq_dims: dict
    seq_lengths: list
    on_cache_heads: dict
    over_cache_heads: dict
    projections: dict[fx.Node, tuple[bool, int]]
    starts: set[fx.Node]  # where sharding may start
    vmap_bodies: list[tuple[list[fx.Node], list[fx.Node]]]  # (the values entering a vmap, its body's nodes)

    @classmethod
    def of(cls, gm: fx.GraphModule, ctx, sites: list) -> "_GraphFacts":
        bases = alias_bases(gm.graph)
        written = written_bases(gm.graph, bases)
        mixed = _mixed_inputs(gm.graph, sites)
        feeds_mixers = ancestors(node for node, _ in mixed)
        feeds_masks = ancestors(mask for site in sites for mask in site.mask_inputs())
        head_parallel = _head_parallel_nodes(sites)
        reads_lazy = {user for placeholder in ctx.lazy_inputs for user in placeholder.users}
        # A view of a value written in place is not where sharding starts: it would view a sliced copy.
        views_of_written = {node for node in gm.graph.nodes if may_alias(node) and bases[node] in written}
        on_cache_heads = {site.node: site for site in sites if site.on_cache_heads}
        # Decoding on a cache's heads: the cache and the projections onto heads are sharded (over heads), the
        # new positions stay whole.
        starts = (reads_lazy if on_cache_heads else feeds_mixers | reads_lazy) - feeds_masks - views_of_written
        return cls(
            bases=bases,
            writes=[(node, mutated_arg(node)) for node in gm.graph.nodes if isinstance(mutated_arg(node), fx.Node)],
            order={node: index for index, node in enumerate(gm.graph.nodes)},
            attention=set(head_parallel) | {site.node for site in sites},
            site_nodes={site.node for site in sites if site.scores is None},
            head_parallel=head_parallel,
            seq_dims=sequence_dims(mixed, ctx.parameters),
            seq_lengths=[node.meta["example_value"].shape[dim] for node, dim in mixed],
            on_cache_heads=on_cache_heads,
            over_cache_heads={site.node: site for site in sites if site.kv_on_cache_heads},
            projections=_projections_onto_heads(on_cache_heads.values(), ctx.parameters),
            starts=starts,
            vmap_bodies=_vmap_bodies(gm.graph),
        )


def _settle(gm: fx.GraphModule, ctx, facts: _GraphFacts, moves: dict) -> "_Placed":
    """Place every node, with the inputs ``moves`` names moved off the sequence; returns the placement
    that needs no further revisit.

    A view taken by an op with no sharded form views a gathered copy, which misses writes made to its
    base after the view (and takes writes made through it); a position read (a rank's part of a
    reduction) takes writes made through it on the reduced copy. Where that happens, the written value
    is placed whole from where it is made, so its views are real views; placing it whole can change
    other placements, so this repeats until no new value is found."""
    bases, writes, order = facts.bases, facts.writes, facts.order
    whole: dict[fx.Node, str] = {}  # value kept whole -> why
    refused: dict[str, str] = {}  # a local sort whose rows are not put back in order -> the reader
    while True:
        placed = _place_all(gm, ctx, facts, whole, refused, moves)
        found = {}
        for view in placed.copies:  # a view of a gathered copy: stale after a later write to its base
            if bases[view] not in whole and any(order[writer] > order[view] and bases[target] is bases[view]
                                                for writer, target in writes):
                found.setdefault(bases[view], view)
        for view in placed.reductions:  # a rank's part of a reduction: a write through it lands on the reduced copy
            if bases[view] not in whole and any(_viewed_through(target, view, bases) for _, target in writes):
                found.setdefault(bases[view], view)
        for base, view in found.items():
            if base in facts.attention:
                raise UnsupportedError(
                    f"{base.name} (inside an attention at {module_path(base) or base.name}) is written in place and viewed by "
                    f"{view.name} ({view.target}), which has no sequence-sharded view here (it would run on a "
                    f"gathered copy, or move its rows), so the view would be a copy that misses the write; write it out of place (for example y = y * s instead of y.mul_(s))"
                )
            whole[base] = f"it is written in place and viewed by {view.name}, which cannot stay sharded, so it is kept whole"
        for base, (writer, refusal) in placed.whole_writes.items():
            if base in whole or not (base.target in FRESH_BUFFERS or is_gathering_index(base)):
                raise UnsupportedError(refusal)
            whole[base] = f"{writer.name} ({_op(writer)}) writes into it in a way that cannot stay sharded, so it is made whole"
        for sort, reader in placed.stranded.items():
            refused.setdefault(sort, f"{reader.name} ({_op(reader)}) reads its rows before they are put back in "
                                     f"token order, so the sort runs on the whole sequence")
        communicating = [entry for entry in _communicating_vmaps(facts.vmap_bodies, placed) if entry.name not in refused]
        for entry in communicating:
            refused[entry.name] = ("the vmapped body it enters would communicate between ranks (no collective "
                                   "runs inside vmap), so it enters whole")
        if not (found or placed.whole_writes or placed.stranded or communicating):
            return placed


def _vmap_bodies(graph: fx.Graph) -> list[tuple[list[fx.Node], list[fx.Node]]]:
    """Each vmap in the graph (torch's generic associative scan vmaps its combine): the values entering
    it (``_add_batch_dim``) and the nodes between its nesting's increment and decrement."""
    nodes = list(graph.nodes)
    opened, bodies = [], []
    for index, node in enumerate(nodes):
        if node.op == "call_function" and node.target is vmap_increment_nesting:
            opened.append(index)
        elif node.op == "call_function" and node.target is vmap_decrement_nesting and opened:
            body = nodes[opened.pop():index + 1]
            bodies.append(([n for n in body if n.op == "call_function" and n.target is add_batch_dim], body))
    return bodies


def _communicating_vmaps(bodies: list, placed: "_Placed") -> list[fx.Node]:
    """The values entering each vmap whose body has a fallback or converts a rank-local value: a
    collective there would run on batched tensors, so the vmap runs on whole values instead."""
    fallbacks = {fallback.node for fallback in placed.fallbacks}

    def communicates(node: fx.Node) -> bool:
        return node.name in fallbacks or any(is_rank_local(have) and have != want
                                             for _, have, want in _held_and_wanted(node))

    return [entry for entries, body in bodies if any(communicates(node) for node in body) for entry in entries]


def _held_and_wanted(node: fx.Node):
    """For each placed input of a placed node: (the input, its placement, the placement the node reads it in)."""
    sharding = sharding_of(node)
    if sharding is None:
        return
    for arg in node.all_input_nodes:
        if sharding_of(arg) is not None:
            yield arg, sharding_of(arg).output, sharding.inputs.get(arg, REPLICATE)


def _viewed_through(target: fx.Node, view: fx.Node, bases: dict) -> bool:
    """Whether ``target`` is ``view`` or a view (of a view...) of it."""
    while target is not None and target is not view and bases.get(target) is not target:
        target = target.args[0] if target.args and isinstance(target.args[0], fx.Node) else None
    return target is view


@dataclass
class _Placed:
    fallbacks: list[Fallback] = field(default_factory=list)
    copies: list[fx.Node] = field(default_factory=list)  # views placed as views of a gathered copy
    reductions: list[fx.Node] = field(default_factory=list)  # views placed as a rank's part of a reduction
    # a written value's base -> the write that cannot stay sharded, and the error if the base cannot be made whole
    whole_writes: dict[fx.Node, tuple[fx.Node, str]] = field(default_factory=dict)
    stranded: dict[str, fx.Node] = field(default_factory=dict)  # local sort -> a node reading its rows unordered
    gathered: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)  # (a fallback, a rank-local input it gathers)
    whole_operands: list[str] = field(default_factory=list)


def _place_all(gm, ctx, facts: _GraphFacts, whole, refused, moves) -> _Placed:
    """Place every node; returns what propagation must revisit."""
    on_cache_heads, over_cache_heads, head_parallel = facts.on_cache_heads, facts.over_cache_heads, facts.head_parallel
    view = RuleView(_output_placement, ctx.world_size)
    placed = _Placed()
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op in ("placeholder", "get_attr"):
            place(node, NodeSharding(_replicated_like(value), value))
        elif node.op == "output":
            _find_stranded(node, {}, view, placed)
        elif node in whole:
            like = whole_like(node, view)
            place(node, like or NodeSharding(_replicated_like(value), value, replicate_all(view, node)))
            _find_stranded(node, sharding_of(node).inputs, view, placed)
            if like is not None:
                placed.fallbacks.append(_fallback_report(node, view, whole[node], gathered=False))
            elif any(is_rank_local(view.placement(arg)) for arg in view.tensor_args(node)):
                placed.fallbacks.append(_fallback_report(node, view, whole[node]))
        elif node in on_cache_heads:
            place(node, _on_cache_heads(on_cache_heads[node], value))
        elif node in over_cache_heads:
            place(node, _over_cache_heads(over_cache_heads[node], value))
        elif (projected := _projection_on_heads(node, facts.projections.get(node), view, value)) is not None:
            place(node, projected)
        elif node in head_parallel:
            by_heads, entering = head_parallel[node]
            inputs = {arg: entering.get(arg) or _heads_if_matching(arg, by_heads, value)
                      for arg in view.tensor_args(node)}
            place(node, NodeSharding(by_heads, value, inputs))
        else:
            sharding, fallback, copies = _decide(node, value, view, ctx, node in facts.starts, node in facts.site_nodes,
                                                 facts.seq_dims, facts.seq_lengths, refused.get(node.name),
                                                 moves.get(node))
            placed.fallbacks += [fallback] if fallback is not None else []
            if fallback is not None:
                placed.gathered += [(node, arg) for arg in view.tensor_args(node) if is_rank_local(view.placement(arg))]
            elif is_sharded(sharding.output) and (whole_operands := _whole_operands(node, sharding, view)):
                placed.whole_operands += whole_operands
                if node not in facts.site_nodes:  # a region for the moves: its inputs may go to another dim
                    placed.gathered += [(node, arg) for arg in view.tensor_args(node) if is_sharded(view.placement(arg))]
            if may_alias(node) and (fallback is not None or copies):
                placed.copies.append(node)
            elif may_alias(node) and isinstance(sharding.output, Partial):
                placed.reductions.append(node)
            written_whole = _write_in_place(node, sharding, view, facts.bases)
            if written_whole is not None:
                placed.whole_writes.setdefault(written_whole[0], (node, written_whole[1]))
            _find_stranded(node, sharding.inputs, view, placed)
            place(node, sharding)
    return placed


def _mixed_inputs(graph: fx.Graph, sites) -> list[tuple[fx.Node, int]]:
    """The values entering a layer that mixes positions, each with its sequence dim: every attention's
    q, k and v, every causal convolution's input (``[B, C, S]``)."""
    mixed = [(site.entering(role), site.seq_axis) for site in sites for role in ("query", "key", "value")]
    mixed += [(conv.args[0], -1) for conv in causal_convolutions(graph)]
    mixed = [(node, dim) for node, dim in mixed if isinstance(node, fx.Node)
             and isinstance(node.meta.get("example_value"), torch.Tensor)]
    return [(node, dim % node.meta["example_value"].dim()) for node, dim in mixed]


def _find_stranded(node: fx.Node, inputs: dict, view: RuleView, placed: _Placed) -> None:
    """Permuted rows (or positions into them) that ``node`` would read converted: they have no
    conversion, so their sort must run on whole inputs instead."""
    written = mutated_arg(node)
    for arg in node.all_input_nodes:
        have = view.actual_placement(arg)
        if isinstance(have, (PermutedShard, Positions)) and inputs.get(arg) != have \
                or arg is written and isinstance(have, Partial) and have.over:  # a write into the rank's own counts
            for sort in sort_orders(have):
                placed.stranded.setdefault(sort, node)


def _head_parallel_nodes(sites) -> dict[fx.Node, tuple]:
    """Hand-written attention: k^T, q @ k^T and probs @ v run on this rank's heads (the ops between
    follow). q, k and v enter them sequence-sharded; insert_all_to_all turns them to heads there."""
    nodes = {}
    for site in sites:
        entering = {site.entering(role): Shard(site.seq_axis) for role in ("query", "key", "value")}
        for node, (head_axis, operands) in site.region.items():
            nodes[node] = (site.heads_placement(head_axis),
                           {**{arg: site.heads_placement(dim) for arg, dim in operands.items()}, **entering})
    return nodes


def _on_cache_heads(site, value) -> NodeSharding:
    """An attention decoding over a head-sharded cache: q, k, v and the output the rank's heads, the
    mask whole."""
    by_heads = Shard(site.head_axis)
    inputs = {site.entering(role): by_heads for role in ("query", "key", "value")}
    inputs.update({mask: REPLICATE for mask in site.mask_inputs()})
    return NodeSharding(by_heads, value, inputs)


def _over_cache_heads(site, value) -> NodeSharding:
    """A later prompt over a head-sharded cache: q in sequence blocks (``insert_all_to_all`` sends it to
    the rank's heads and the output back), k and v the rank's heads (the cache's, the new positions'
    joined to them), the mask whole; the output in sequence blocks."""
    inputs = {site.entering("query"): Shard(site.seq_axis)}
    inputs.update({site.entering(role): Shard(site.head_axis) for role in ("key", "value")})
    inputs.update({mask: REPLICATE for mask in site.mask_inputs()})
    return NodeSharding(Shard(site.seq_axis), value, inputs)


def _projections_onto_heads(sites, parameters) -> dict[fx.Node, tuple[bool, int]]:
    """Decoding on a cache's heads: the linear layers that make q, k and v (the nearest on the way back
    from each, whose weight is a parameter with a row per head and head dim) and the one that reads the
    attention's output (the nearest on the way forward, a column per head and head dim) -> (whether it
    makes heads, head dim). Each computes only the rank's heads: q, k and v from the weight's rows of
    them (tensor parallelism's column split), the output's partial sum from its columns (the row split),
    where the whole projections would run on every rank. Where the ops between do not keep the heads
    apart, their rules say so and the value is converted as any other."""
    found = {}

    def nearest(start, step, rows: int, dim: int, makes_heads: bool, head_dim: int) -> None:
        stack, seen = [start], set()
        while stack:
            node = stack.pop()
            if node in seen or not isinstance(node, fx.Node):
                continue
            seen.add(node)
            if node.op == "call_function" and node.target in LINEAR:
                weight = method_or_function_args(node, ("input", "weight"))["weight"]
                if weight in parameters and weight.meta["example_value"].shape[dim] == rows:
                    found[node] = (makes_heads, head_dim)
                continue
            stack.extend(step(node))

    for site in sites:
        for role, heads in (("query", site.heads), ("key", site.kv_heads), ("value", site.kv_heads)):
            nearest(site.entering(role), lambda node: node.all_input_nodes, heads * site.head_dim, 0, True,
                    site.head_dim)
        nearest(site.node, lambda node: node.users, site.heads * site.head_dim, 1, False, site.head_dim)
    return found


def _projection_on_heads(node: fx.Node, found: tuple[bool, int] | None, view: RuleView, value) -> NodeSharding | None:
    """A projection of ``_projections_onto_heads`` on the rank's heads, or None where its input does not
    arrive as that needs: whole, for q, k and v (``linear(x, weight, bias)`` on the rank's rows of the
    weight and bias: the rank's heads of ``[..., heads * head_dim]``); on the rank's heads, for the
    output's (on its columns of the weight: a partial sum, its bias in the first rank's part only)."""
    if found is None:
        return None
    makes_heads, head_dim = found
    args = method_or_function_args(node, ("input", "weight", "bias"))
    x, bias = args["input"], args.get("bias")
    if makes_heads:
        if view.placement(x) != REPLICATE:
            return None
        rows = seq_shard(0, 1, head_dim)
        inputs = {x: REPLICATE, args["weight"]: rows, **({bias: rows} if isinstance(bias, fx.Node) else {})}
        return NodeSharding(seq_shard(value.dim() - 1, 1, head_dim), value, inputs)
    if view.sharded(x) != (view.value(x).dim() - 1, 1, head_dim):
        return None
    inputs = {x: view.placement(x), args["weight"]: seq_shard(1, 1, head_dim)}
    if not isinstance(bias, fx.Node):
        return NodeSharding(PARTIAL, value, inputs)
    return NodeSharding(PARTIAL, value, {**inputs, bias: REPLICATE}, _bias_added_once)


def _bias_added_once(node: fx.Node, sharding: NodeSharding, ctx) -> None:
    """The output projection's bias in the first rank's partial product only (``owned_by``: zeros on the
    others, one code on every rank), so the sum over the ranks adds it once."""
    bias = method_or_function_args(node, ("input", "weight", "bias"))["bias"]
    owned = insert_part(node, "call_function", owned_by, (bias, ctx.rank_for(node.graph), 0))
    place(owned, NodeSharding(PARTIAL, sharding_of(bias).global_value, {bias: REPLICATE}))
    node.replace_input_with(bias, owned)
    inputs = {arg: placement for arg, placement in sharding.inputs.items() if arg is not bias}
    place(node, NodeSharding(sharding.output, sharding.global_value, {**inputs, owned: PARTIAL}))


def _heads_if_matching(arg: fx.Node, by_heads: Shard, value):
    """A bias or mask entering the head-parallel region (baddbmm's input): its rank's heads when it has
    the heads dim, whole when it broadcasts over heads."""
    arg_value = arg.meta.get("example_value")
    offset = arg_value.dim() - value.dim()
    dim = by_heads.dim + offset
    if 0 <= dim < arg_value.dim() and arg_value.shape[dim] == value.shape[by_heads.dim]:
        return with_dim(by_heads, dim)
    return REPLICATE



def _output_placement(node: fx.Node):
    sharding = sharding_of(node)
    return sharding.output if sharding is not None else None


def _replicated_like(value):
    if isinstance(value, torch.Tensor):
        return REPLICATE
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(REPLICATE if isinstance(v, torch.Tensor) else None for v in value)
    return None


def _decide(node: fx.Node, value, view: RuleView, ctx, starts_sharding: bool, is_site: bool, seq_dims: dict,
            seq_lengths: list, refused: str | None, moved: dict | None) -> tuple[NodeSharding, Fallback | None, bool]:
    tensor_args = view.tensor_args(node)
    placements = [view.placement(arg) for arg in tensor_args]
    if any(is_permuted(p) for p in placements):
        rule = rule_for(node, permuted=True)
        decision = rule(node, view) if rule else None
        if decision is not None:
            return NodeSharding(decision.output, value, decision.inputs, decision.localize), None, decision.copies
        if any(isinstance(p, (PermutedShard, Positions)) for p in placements):
            # No rule for global layouts may read them: propagation makes their sort run whole instead.
            return NodeSharding(_replicated_like(value), value, replicate_all(view, node)), None, False
    rule = None if refused else rule_for(node)
    pending = {arg: completed(p) for arg, p in zip(tensor_args, placements)
               if not isinstance(p, tuple) and completed(p) != p}
    if pending:
        # Rules see completed values: a partial sum is all-reduced, a partial scan finished, first.
        view = view.overridden(pending)
    lazy = {arg: ctx.lazy_inputs[arg] for arg in tensor_args if arg in ctx.lazy_inputs}
    if lazy and any(is_rank_local(view.placement(arg)) for arg in tensor_args if arg not in lazy):
        # A block a graph before this one left (a key/value cache on its heads) met with rank-local values
        # is read as it lies, not gathered first.
        view = view.overridden(lazy)
    if not is_site and not any(is_rank_local(view.placement(arg)) for arg in tensor_args):
        # An in-place op is never where sharding starts: it would write into a sliced copy.
        seeded = _seed(node, value, view, ctx, rule, seq_dims, seq_lengths) \
            if starts_sharding and rule and mutated_arg(node) is None else None
        return seeded or NodeSharding(_replicated_like(value), value), None, False
    decision = rule(node, view) if rule else None
    if rule and moved and (decision is None or _taken_whole(decision.inputs, view)):
        decision = rule(node, view.overridden(moved)) or decision
    if decision is None and rule:
        decision = _moved_decision(node, view, rule, seq_lengths)
    fallback = None
    if decision is None:
        reason = refused or ("no sharding rule for this op" if rule_for(node) is None
                             else "its sharded inputs cannot stay sharded here")
        sharding = NodeSharding(_replicated_like(value), value, replicate_all(view, node))
        fallback = _fallback_report(node, view, reason)
    else:
        sharding = NodeSharding(decision.output, value, {**pending, **decision.inputs}, decision.localize)
        if _writes_into_a_copy(node, sharding, view):
            sharding = NodeSharding(_replicated_like(value), value, replicate_all(view, node))
            fallback = _fallback_report(node, view, "it writes in place into a whole tensor, which stays whole")
    return sharding, fallback, decision is not None and fallback is None and decision.copies


def _moved_decision(node: fx.Node, view: RuleView, rule, seq_lengths: list):
    """The rule's answer with inputs held along another dim taken back to the sequence; None if it has
    none."""
    back = {}
    for arg in view.tensor_args(node):
        factors = view.sharded(arg)
        dim = _sequence_dim(view.value(arg), seq_lengths)
        if factors is None or dim is None:
            continue
        held, outer, _ = factors
        length = view.value(arg).shape[dim]
        if outer == 1 and held != dim and (is_symbolic(length) or length >= view.world_size):
            back[arg] = Shard(dim)
    decision = rule(node, view.overridden(back)) if back else None
    return decision or _as_the_sequence_is(node, view, rule, seq_lengths)


def _as_the_sequence_is(node: fx.Node, view: RuleView, rule, seq_lengths: list):
    """The rule's answer with inputs held along another dim taken to the placement of an input of the
    same shape that holds the sequence (both merged into one dim, as ``[B*S*H, D]`` is: over H, over
    S); None if it has none."""
    local = [arg for arg in view.tensor_args(node) if view.sharded(arg) is not None]

    def sharded_length(arg):
        held, outer, inner = view.sharded(arg)
        return view.value(arg).shape[held] // (outer * inner)

    def same_shape(a, b):
        a, b = view.value(a).shape, view.value(b).shape
        return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))

    on_sequence = [arg for arg in local if any(same_size(sharded_length(arg), length) for length in seq_lengths)]
    for holder in on_sequence:
        back = {arg: view.placement(holder) for arg in local if arg not in on_sequence and same_shape(arg, holder)}
        decision = rule(node, view.overridden(back)) if back else None
        if decision is not None:
            return decision
    return None


def _moves_off_the_sequence(gm: fx.GraphModule, ctx, sites: list, facts: _GraphFacts,
                            settled: _Placed) -> tuple[dict, _Placed]:
    """Ops that run whole on gathered sequences, grouped where their whole results meet (a region:
    the chunked scan of a state-space layer, each of its inputs gathered): the inputs a region gathers
    taken instead to a dim of one size that each of them has (the scan's heads), where the graph then
    communicates fewer elements (``_communicated``); node -> {input: placement}. Each size, the largest first, is
    tried in every region that has it and no dim yet (a model's layers alike: one try for all) by
    placing the graph again: the rules decide which dims the ops keep apart. Returns the moves and
    the placement made with them, which the graph's nodes hold. Not under a ring, whose head-tail
    layout (chosen after) would make each move a gather."""
    if any(site.ring != 1 for site in sites):
        return {}, settled
    moves: dict[fx.Node, dict] = {}
    best, kept = _communicated(gm.graph, ctx.world_size), (settled, _placements(gm.graph))
    regions = [_dims_by_size(region, ctx.world_size) for region in _gathering_regions(gm.graph, settled.gathered)]
    moved_regions: set[int] = set()
    for size in sorted({size for dims in regions for size in dims}, reverse=True):
        taking = [index for index, dims in enumerate(regions) if index not in moved_regions and size in dims]
        if not taking:
            continue
        trial = dict(moves)
        for node, arg, dim in (move for index in taking for move in regions[index][size]):
            trial[node] = {**trial.get(node, {}), arg: Shard(dim)}
        try:
            placed = _settle(gm, ctx, facts, trial)
        except UnsupportedError:  # an in-place write the moved inputs would land on a copy of
            continue
        cost = _communicated(gm.graph, ctx.world_size)
        if cost < best:
            best, moves, kept = cost, trial, (placed, _placements(gm.graph))
            moved_regions.update(taking)
    for node, sharding in kept[1].items():
        place(node, sharding)
    return moves, kept[0]


def _placements(graph: fx.Graph) -> dict[fx.Node, NodeSharding]:
    return {node: sharding_of(node) for node in graph.nodes if sharding_of(node) is not None}


def _describe_moves(moves: dict) -> list[str]:
    """Each module whose values went off the sequence (its ops called at the model's top level: "the
    model"), and to which dims; not those computed there already."""
    moved: dict[str, dict] = {}
    for node, inputs in moves.items():
        for arg, placement in inputs.items():
            if sharding_of(arg).output == placement:
                continue
            shape = list(arg.meta["example_value"].shape)
            moved.setdefault(module_path(node) or "the model", {})[arg.name] = f"{arg.name} {shape} to dim {placement.dim}"
    return [f"{module}: {', '.join(values.values())}" for module, values in moved.items()]


def _communicated(graph: fx.Graph, world_size: int) -> float:
    """About how many elements a rank receives in the conversions the graph's placements ask for: a
    gather the whole value, an all-reduce of a partial sum twice that, an all-to-all 1/P of it."""
    total, seen = 0.0, set()
    for node in graph.nodes:
        for arg, have, want in _held_and_wanted(node):
            value = arg.meta.get("example_value")
            if isinstance(have, tuple) or not isinstance(value, torch.Tensor) or (arg, want) in seen:
                continue
            seen.add((arg, want))
            elements = size_hint(value.numel())
            if completed(have) != have:
                total += 2 * elements
                have = completed(have)
            if is_rank_local(have) and have != want:
                total += elements / world_size if all_to_all_converts(value, have, want, world_size) else elements
    return total


def _gathering_regions(graph: fx.Graph, gathered: list) -> list[list[tuple[fx.Node, fx.Node]]]:
    """The (fallback, gathered input) pairs grouped by region: fallbacks joined by the values computed
    whole from them."""
    fallbacks = {node for node, _ in gathered}
    root: dict[fx.Node, fx.Node] = {}

    def find(node):
        while root[node] is not node:
            node = root[node]
        return node

    for node in graph.nodes:
        joined = [find(arg) for arg in node.all_input_nodes if arg in root]
        sharding = sharding_of(node)
        if node in fallbacks or joined and sharding is not None and not is_rank_local(sharding.output):
            root[node] = joined[0] if joined else node
            for other in joined[1:]:
                root[other] = root[node]
    regions: dict[fx.Node, list] = {}
    for node, arg in gathered:
        regions.setdefault(find(node), []).append((node, arg))
    return list(regions.values())


def _dims_by_size(region: list, world_size: int) -> dict[int, list[tuple[fx.Node, fx.Node, int]]]:
    """Each size of a dim that every gathered input of the region has besides its sequence (each a plain
    block of the sequence), at least P -> (fallback, input, its first dim of that size) for each."""
    found: dict[int, list] | None = None
    for node, arg in region:
        placement = sharding_of(arg).output
        if not isinstance(placement, Shard):
            return {}
        dims: dict[int, int] = {}
        for dim, length in enumerate(arg.meta["example_value"].shape):
            if dim != placement.dim and not is_symbolic(length) and length >= world_size:
                dims.setdefault(int(length), dim)
        found = {size: [(node, arg, dim)] for size, dim in dims.items()} if found is None else \
            {size: [*moves, (node, arg, dims[size])] for size, moves in found.items() if size in dims}
    return found or {}


def _writes_into_a_copy(node: fx.Node, sharding: NodeSharding, view: RuleView) -> bool:
    """An op that writes into a whole (replicated) tensor but would receive it sliced: the write would
    land on the slice, and later readers of the whole tensor would miss it."""
    written = mutated_arg(node)
    if not isinstance(written, fx.Node):
        return False
    have = view.actual_placement(written)
    return not is_rank_local(have) and sharding.inputs.get(written, REPLICATE) != completed(have)


def _write_in_place(node: fx.Node, sharding: NodeSharding, view: RuleView, bases: dict) -> tuple[fx.Node, str] | None:
    """An op that writes into a rank-local tensor must run on that very tensor, never on a gathered or
    reduced copy: later readers of the tensor would miss the write. Returns the written value's base and
    the error to raise unless that base is a new buffer (``zeros_like``), which can be made whole instead.
    Permuted rows are left to their sort, which then runs whole."""
    written = mutated_arg(node)
    if not isinstance(written, fx.Node):
        return None
    have = view.actual_placement(written)
    if not is_rank_local(have) or is_permuted(have) or sharding.inputs.get(written, REPLICATE) == completed(have):
        return None
    source = (node.meta.get("stack_trace") or "").strip().splitlines()[-2:]
    return bases.get(written, written), (
        f"{node.name} ({node.target}) writes in place into {written.name}, which is "
        f"{describe(have)} (split over the sequence-parallel ranks) here, and this op has no sharded "
        f"form; write it out of place (for example x = x.relu() instead of x.relu_(), or torch.cat / "
        f"torch.where instead of an indexed assignment). At: {' / '.join(line.strip() for line in source)}"
    )


def _seed(node, value, view, ctx, rule, seq_dims, seq_lengths) -> NodeSharding | None:
    """``node`` with its first sequence-holding input offered sharded (a value a graph before this one
    left lazily first, in the layout it holds), if its rule keeps the output sharded."""
    args = [arg for arg in view.tensor_args(node) if arg not in ctx.parameters]
    for arg in sorted(args, key=lambda arg: arg not in ctx.lazy_inputs):
        if arg in ctx.lazy_inputs:
            offered = ctx.lazy_inputs[arg]
        else:
            dim = seq_dims[arg] if arg in seq_dims else _sequence_dim(view.value(arg), seq_lengths)
            if dim is None:
                continue
            offered = Shard(dim)
        seeded_view = view.overridden({arg: offered})
        decision = rule(node, seeded_view)
        if decision is not None and is_sharded(decision.output):
            return NodeSharding(decision.output, value, decision.inputs, decision.localize)
        return None
    return None


def _sequence_dim(value, seq_lengths) -> int | None:
    """The dim of a replicated tensor that holds the sequence: a dim of a sequence length, preferring
    the last such dim that is not the feature (last) dim, so [B, S] and [B, S, H] pick S."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    dims = [d for d, size in enumerate(value.shape) if any(same_size(size, length) for length in seq_lengths)]
    if len(dims) > 1 and dims[-1] == value.dim() - 1:
        dims = dims[:-1]
    return dims[-1] if dims else None


def _op(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def _taken_whole(inputs: dict, view: RuleView) -> list[fx.Node]:
    """The sequence-sharded tensors among a rule's inputs that it takes whole (gathered)."""
    return [arg for arg, want in inputs.items() if want == REPLICATE and is_sharded(view.placement(arg))
            and isinstance(view.value(arg), torch.Tensor)]


def _whole_operands(node: fx.Node, sharding: NodeSharding, view: RuleView) -> list[str]:
    """A line for each sequence-sharded input of ``node`` that its rule takes whole while the node keeps
    its rows: the rank's queries against every key of a sparse attention's indexer."""
    return [f"{node.name} ({_op(node)}) keeps its rows and reads {arg.name} "
            f"{list(view.value(arg).shape)} whole: it is gathered, not its other inputs"
            for arg in _taken_whole(sharding.inputs, view)]


def _fallback_report(node, view, reason, gathered: bool = True) -> Fallback:
    sharded_inputs = [arg.name for arg in view.tensor_args(node) if is_rank_local(view.placement(arg))]
    source = (node.meta.get("stack_trace") or "").strip().splitlines()
    return Fallback(
        node=node.name,
        op=_op(node),
        reason=f"{reason}; gathered {', '.join(sharded_inputs)}" if gathered else
        f"{reason}, from its global shape (nothing gathered)",
        source=" / ".join(line.strip() for line in source[-2:]),
    )
