"""Find every attention site in a Dynamo graph and decide, up front, whether it can be parallelized.

Before (a Dynamo graph)::

    attn = torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, ...)
    probs = F.softmax(q @ k.transpose(-2, -1) * scale + mask, dim=-1)       # written by hand
    out = probs @ v

After: the hand-written result passes through ``attention_output(out)`` (an identity that marks where
the head-parallel region ends); otherwise the graph is unchanged. It returns a :class:`Detection`: one
:class:`AttentionSite` per call, read by the form the node belongs to (``ulysses_compile/passes/attention_forms/``),
with its module path, heads, KV heads, head dim, sequence lengths and mask, and why each softmax or
attention call that is not a site is not. A site with fewer heads than ranks raises here, before any
rewrite. A symbolic sequence length is guarded to its class (``sizes.pin_length_class``), the same on
every rank.

Pinned on a small model: ``tests/test_pass_goldens.py::test_detect_attention``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch.fx as fx

from ulysses_compile.core.compat import recompute_region
from ulysses_compile.core.errors import DivisibilityError
from ulysses_compile.core.report import module_path
from ulysses_compile.core.sharding import block_sizes
from ulysses_compile.core.sizes import pin_length_class
from ulysses_compile.passes.attention_forms import AttentionSite, reading_form

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
        _check_heads(site, ctx.world_size)
        pin_length_class(site.seq_len, ctx.world_size)
        pin_length_class(site.kv_seq_len, ctx.world_size)
        site = replace(site, decision=_decision(site, ctx.world_size))
        log.debug("ulysses_compile: attention %s", site.summary())
        sites.append(site)
    return Detection(sites, rejected)


def _decision(site: AttentionSite, world_size: int) -> str:
    heads = ",".join(str(size) for size in block_sizes(site.heads, world_size))
    kv = "by all-to-all" if site.kv_by_all_to_all(world_size) else "gathered per query head"
    checkpointed = ", in a checkpointed region (recomputed in the backward)" if recompute_region(site.node) is not None else ""
    return f"parallelized: heads per rank {heads}, key/value {kv}{checkpointed}"


def _check_heads(site: AttentionSite, world_size: int) -> None:
    """Heads and sequences split over the ranks in balanced blocks, so any count works as long as every
    rank gets a head; key/value heads that do not split like the query heads are gathered."""
    where = f"attention {site.module or site.node.name} ({site.spelling})"
    if site.heads < world_size:
        raise DivisibilityError(
            f"{where}: {site.heads} query heads cannot be split over {world_size} sequence-parallel ranks; "
            f"Ulysses gives each rank at least one whole head. Use at most {site.heads} ranks for sequence "
            f"parallelism (with a mesh, put the other ranks on a \"dp\" dim), or a model with at least "
            f"{world_size} heads"
        )
