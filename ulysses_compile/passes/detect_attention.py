"""Find every attention site in a Dynamo graph and decide, up front, whether it can be parallelized.

Before (a Dynamo graph)::

    attn = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, ...)
    probs = F.softmax(q @ k.transpose(-2, -1) * scale + mask, dim=-1)       # written by hand
    out = probs @ v

After: the hand-written result passes through ``attention_output(out)`` (an identity that marks where
the head-parallel region ends), or, where the site is planned with a ring, the products and what is
between them become the one ``scaled_dot_product_attention`` call they compute
(``AttentionForm.as_ring_site``); otherwise the graph is unchanged. It returns a :class:`Detection`: one
:class:`AttentionSite` per call, read by the form the node belongs to (``ulysses_compile/passes/attention_forms/``),
with its module path, heads, KV heads, head dim, sequence lengths and mask, and why each softmax or
attention call that is not a site is not, and each site's plan (``_planned``: Ulysses over every rank,
or Ulysses x ring; or, decoding fewer new tokens than ranks over a key/value cache a graph before left
on the rank's heads, ``on_cache_heads``). A site with no plan raises here, before any rewrite. A
symbolic sequence length that is split is guarded to its class (``sizes.pin_length_class``), the same
on every rank.

Pinned on a small model: ``tests/test_pass_goldens.py::test_detect_attention``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch.fx as fx

from ulysses_compile.core.collectives import ranks_per_node
from ulysses_compile.core.compat import recompute_region
from ulysses_compile.core.errors import DivisibilityError
from ulysses_compile.core.report import module_path
from ulysses_compile.core.fx_graph import value_ancestors
from ulysses_compile.core.sharding import Shard, block_sizes
from ulysses_compile.core.sizes import is_symbolic, pin_length_class
from ulysses_compile.passes.attention_forms import AttentionSite, reading_form
from ulysses_compile.passes.attention_forms.sdpa import SDPA

log = logging.getLogger("ulysses_compile")


@dataclass(frozen=True)
class Detection:
    sites: list[AttentionSite]
    rejected: list[str]  # "module: why this softmax or attention call is not parallelized"


def detect_attention(gm: fx.GraphModule, ctx) -> Detection:
    sites, rejected = [], []
    for node in list(gm.graph.nodes):
        form = reading_form(node)
        if form is None:
            continue
        site = form.read(node)
        if not isinstance(site, AttentionSite):
            if site is not None:
                rejected.append(f"{module_path(node) or node.name}: {site}")
                log.debug("ulysses_compile: not attention at %s: %s", node.name, site)
            continue
        over_cache = _reads_cache_heads(site, ctx)
        if over_cache and _decodes(site, ctx):  # no length is split: no guard on its class
            site = _on_cache_heads(site, ctx.world_size)
        elif over_cache:
            pin_length_class(site.seq_len, ctx.world_size)
            site = _over_cache_heads(site, ctx.world_size)
        else:
            pin_length_class(site.seq_len, ctx.world_size)
            pin_length_class(site.kv_seq_len, ctx.world_size)
            site = _planned(site, ctx)
        log.debug("ulysses_compile: attention %s", site.summary())
        sites.append(site)
    return Detection(sites, rejected)


def _planned(site: AttentionSite, ctx) -> AttentionSite:
    """The site with its plan (Ulysses over ``ulysses`` ranks, a ring over ``ring``) and the reason.

    Ulysses over the whole group where the heads allow it and the group is on one node (or the option
    ``ring=1``); else Ulysses over the largest groups of consecutive ranks that split the query heads
    and the key/value heads alike (no key/value head is repeated round the ring) and share a node, and
    a ring over the groups; ``ring=R`` sets the ring's size. Past a node only (at least as many heads as ranks),
    a site that cannot run as a ring, or whose ring would be every rank, keeps Ulysses over the group."""
    world_size, forced = ctx.world_size, ctx.options.ring
    node = ranks_per_node(ctx.group_name)
    if forced == 1 or forced is None and site.heads >= world_size and node == world_size:
        _check_heads(site, world_size)
        return replace(site, ulysses=world_size, decision=_decision(site, world_size))
    where = f"attention {site.module or site.node.name} ({site.spelling})"
    blocker = site.form.ring_blocker(site, world_size)
    if forced is not None:
        ulysses = world_size // forced
        mesh = ctx.options.mesh is not None and "ring" in ctx.options.mesh.mesh_dim_names
        source, undo = (f"the mesh's 'ring' dim of {forced} ranks", "use a mesh without a 'ring' dim") if mesh \
            else (f"option ring={forced}", "leave ring unset")
        if blocker is not None:
            raise DivisibilityError(f"{where}: {source}: this attention cannot run as a ring: {blocker}; "
                                    f"{undo} (or ring=1) for Ulysses over the {world_size} ranks")
        if world_size % forced or site.heads < ulysses or not site.kv_by_all_to_all(ulysses):
            raise DivisibilityError(
                f"{where}: {source} over {world_size} ranks leaves Ulysses groups of "
                f"{world_size / forced:g} ranks, which must be a whole number that splits the {site.heads} query "
                f"heads and the {site.kv_heads} key/value heads alike; choose a ring of "
                f"{_ring_sizes(site, world_size)} ranks, or {undo} to plan it")
        why = f"the {source}"
    else:
        ulysses = max(u for u in _divisors(world_size) if node % u == 0 and site.heads % u == 0
                      and site.kv_by_all_to_all(u))
        if site.heads >= world_size and (blocker is not None or ulysses == 1):
            reason = blocker or "no group on one node splits the query and key/value heads, and a ring of " \
                                "every rank leaves the causal work uneven"
            return replace(site, ulysses=world_size,
                           decision=f"{_decision(site, world_size)}; across nodes without a ring: {reason}")
        if blocker is not None:
            raise DivisibilityError(
                f"{where}: {site.heads} query heads over {world_size} sequence-parallel ranks need a ring (Ulysses "
                f"gives each rank at least one whole head), and this attention cannot run as one: {blocker}. Use "
                f"at most {site.heads} ranks for sequence parallelism (with a mesh, put the others on a \"dp\" dim)")
        limits = [f"{site.heads} query / {site.kv_heads} key/value heads"] + (
            [f"{node} ranks per node"] if node < world_size else [])
        why = f"the largest group that splits {' and fits '.join(limits)}"
    ring = world_size // ulysses
    heads = _heads_per_rank(site, ulysses)
    plan = f"a ring over {ring} ranks (heads per rank {heads})" if ulysses == 1 else \
        f"Ulysses over {ulysses} ranks (heads per rank {heads}) x ring over {ring} ranks"
    return replace(site.form.as_ring_site(site), ulysses=ulysses, ring=ring,
                   decision=f"parallelized: {plan}, {why}{_checkpointed(site)}")


def _on_cache_heads(site: AttentionSite, world_size: int) -> AttentionSite:
    heads = _heads_per_rank(site, world_size)
    new = f"{site.seq_len} new position" + ("s" if site.seq_len != 1 else "")
    return replace(site, ulysses=world_size, on_cache_heads=True, decision=(
        f"parallelized on the rank's heads of its key/value cache (heads per rank {heads}; {new}, fewer than "
        f"the ranks): no all-to-all"))


def _decodes(site: AttentionSite, ctx) -> bool:
    """Fewer new positions than ranks (a static count): a decoding step."""
    return not is_symbolic(site.seq_len) and site.seq_len < ctx.world_size


def _over_cache_heads(site: AttentionSite, world_size: int) -> AttentionSite:
    heads = _heads_per_rank(site, world_size)
    return replace(site, ulysses=world_size, kv_on_cache_heads=True, decision=(
        f"parallelized: heads per rank {heads}, the query by all-to-all, keys and values on the rank's heads "
        f"of its key/value cache (the new positions' joined to them by all-to-all)"))


def _reads_cache_heads(site: AttentionSite, ctx) -> bool:
    """Whether the site attends over a head-sharded key/value cache: an SDPA call under Ulysses alone
    (a query head or more per rank) whose key and value are each computed from a value the query is
    not, which a graph before this one left sharded on its heads dim (the cache it returned), with
    key/value heads that split like the query heads."""
    if site.form is not SDPA or site.heads < ctx.world_size or not site.kv_by_all_to_all(ctx.world_size) \
            or ctx.options.ring not in (None, 1):
        return False
    on_heads = {node for node, placement in ctx.lazy_inputs.items() if placement == Shard(site.head_axis)
                and node.meta["example_value"].shape[site.head_axis] == site.kv_heads}
    query = value_ancestors([site.entering("query")])
    return all(on_heads & value_ancestors([site.entering(role)]) - query for role in ("key", "value"))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ring_sizes(site: AttentionSite, world_size: int) -> str:
    return " or ".join(str(world_size // u) for u in _divisors(world_size)
                       if u <= site.heads and site.kv_by_all_to_all(u))


def _decision(site: AttentionSite, world_size: int) -> str:
    heads = _heads_per_rank(site, world_size)
    kv = "by all-to-all" if site.kv_by_all_to_all(world_size) else "gathered per query head"
    return f"parallelized: heads per rank {heads}, key/value {kv}{_checkpointed(site)}"


def _heads_per_rank(site: AttentionSite, ranks: int) -> str:
    return ",".join(str(size) for size in block_sizes(site.heads, ranks))


def _checkpointed(site: AttentionSite) -> str:
    return ", in a checkpointed region (recomputed in the backward)" if recompute_region(site.node) is not None else ""


def _check_heads(site: AttentionSite, world_size: int) -> None:
    """Heads and sequences split over the ranks in balanced blocks, so any count works as long as every
    rank gets a head (reached only with the option ``ring=1``: otherwise a ring takes the rest);
    key/value heads that do not split like the query heads are gathered."""
    where = f"attention {site.module or site.node.name} ({site.spelling})"
    if site.heads < world_size:
        raise DivisibilityError(
            f"{where}: {site.heads} query heads cannot be split over {world_size} sequence-parallel ranks; "
            f"Ulysses gives each rank at least one whole head, and the option ring=1 rules out a ring over "
            f"the others. Leave ring unset (a ring is then planned), or use at most {site.heads} ranks for "
            f"sequence parallelism (with a mesh, put the other ranks on a \"dp\" dim)"
        )
