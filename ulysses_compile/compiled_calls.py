"""What Dynamo enters around every call of a model compiled with the ulysses backend (the backend's
``backend_ctx_ctor``; torch.compile passes it on through ``compat.honour_backend_contexts``): checkpointed
regions whose Python code mutates state are traced whole for this model's calls only, and a call that
compiled code on several ranks but parallelized no attention says so once, on rank 0, with the graph
breaks Dynamo met meanwhile. That covers code our backend never sees: a frame, or a checkpointed region,
that Dynamo runs eagerly after a graph break inside it."""

from __future__ import annotations

import collections
import functools
import logging

import torch.distributed as dist

from .compat import checkpointed_side_effects_traced, dynamo_counters, first_line

log = logging.getLogger("ulysses_compile")


class CompiledCall:
    # What the backend's graphs did in this process (``count``): attention sites parallelized, and graphs
    # on a sequence group of one rank (nothing to parallelize there).
    sites = 0
    single_rank_graphs = 0

    @classmethod
    def count(cls, sites: int, world_size: int) -> None:
        cls.sites += sites
        cls.single_rank_graphs += world_size == 1

    def __enter__(self) -> CompiledCall:
        self._setting = checkpointed_side_effects_traced()
        self._setting.__enter__()
        self._before = (CompiledCall.sites, CompiledCall.single_rank_graphs)
        self._frames = dynamo_counters["frames"]["total"]
        self._breaks = collections.Counter(dynamo_counters["graph_break"])
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._setting.__exit__(kind, error, traceback)
        compiled = dynamo_counters["frames"]["total"] > self._frames
        if kind is None and compiled and (CompiledCall.sites, CompiledCall.single_rank_graphs) == self._before \
                and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
            _warn_once(unparallelized(collections.Counter(dynamo_counters["graph_break"]) - self._breaks))


def unparallelized(breaks: collections.Counter) -> str:
    """Why a call compiled on several ranks parallelized no attention, and what to do."""
    if not breaks:
        return ("this call compiled code with no attention parallelized: Dynamo's graphs hold none the backend "
                "recognizes, so every rank computes the whole sequence (python -m ulysses_compile explain lists "
                "what was rejected and why)")
    met = "; ".join(f"{first_line(reason)} (x{count})" for reason, count in breaks.items())
    return (f"this call compiled code with no attention parallelized: Dynamo met graph breaks ({met}) and ran "
            f"the code around them eagerly, where this backend never sees it (a graph break inside a "
            f"checkpointed region runs the whole region eagerly), so every rank computes the whole sequence. "
            f"Remove the break (TORCH_LOGS=graph_breaks shows where it is)")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("ulysses_compile: %s", message)
