"""What Dynamo enters around every call of a model compiled with the ulysses backend (the backend's
``backend_ctx_ctor``; torch.compile passes it on through ``compat.honour_backend_contexts``): checkpointed
regions whose Python code mutates state are traced whole for this model's calls only, and a call that
compiled code on several ranks but ran no attention parallelized says so once, on rank 0, with the
graph breaks Dynamo met meanwhile. That covers code our backend never sees: a frame, or a checkpointed region,
that Dynamo runs eagerly after a graph break inside it."""

from __future__ import annotations

import collections
import functools
import logging
import sys

import torch.distributed as dist

from ulysses_compile.core.compat import ulysses_tracing, dynamo_counters, first_line

log = logging.getLogger("ulysses_compile")


class CompiledCall:
    # What the backend's graphs did when they ran, in this process (``counted``): attention sites run
    # parallelized, and runs on a sequence group of one rank (nothing to parallelize there).
    sites = 0
    single_rank_runs = 0

    def __enter__(self) -> CompiledCall:
        self._setting = ulysses_tracing()
        self._setting.__enter__()
        self._failing = sys.exc_info()[1]
        self._ran = (CompiledCall.sites, CompiledCall.single_rank_runs)
        self._frames = dynamo_counters["frames"]["total"]
        self._breaks = collections.Counter(dynamo_counters["graph_break"])
        return self

    def __exit__(self, kind, error, traceback) -> None:
        # Dynamo exits with no exception even when the call raised: sys.exc_info() shows it then
        self._setting.__exit__(kind, error, traceback)
        raised = kind is not None or sys.exc_info()[1] is not self._failing
        compiled = dynamo_counters["frames"]["total"] > self._frames
        if not raised and compiled and (CompiledCall.sites, CompiledCall.single_rank_runs) == self._ran \
                and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
            _warn_once(unparallelized(collections.Counter(dynamo_counters["graph_break"]) - self._breaks))


def counted(compiled, sites: int, world_size: int):
    """``compiled``, counting for :class:`CompiledCall` what each run parallelizes."""

    def run(*args):
        CompiledCall.sites += sites
        CompiledCall.single_rank_runs += world_size == 1
        return compiled(*args)

    return run


def unparallelized(breaks: collections.Counter) -> str:
    """Why a call compiled on several ranks ran no attention parallelized, and what to do."""
    if not breaks:
        return ("a call compiled code and ran no attention parallelized: Dynamo's graphs hold none the backend "
                "recognizes, so every rank computes the whole sequence (python -m ulysses_compile explain lists "
                "what was rejected and why)")
    met = "; ".join(dict.fromkeys(first_line(reason) for reason in breaks))
    return (f"a call compiled code and ran no attention parallelized: Dynamo met graph breaks ({met}) and ran "
            f"the code around them eagerly, where this backend never sees it (a graph break inside a "
            f"checkpointed region runs the whole region eagerly), so every rank computes the whole sequence. "
            f"Remove the break (TORCH_LOGS=graph_breaks shows where it is)")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("ulysses_compile: %s", message)
