"""Ranks that disagree get an error, not a hang: on the first call of each compiled graph, the ranks of
the sequence-parallel group compare what they compiled (the captured graph and its input shapes and
dtypes) with one small all-gather, before any collective of the graph runs.

A rank fed another batch shape, or running other code, would otherwise enter collectives of other sizes
or in another order than its peers and wait for them forever.
"""

from __future__ import annotations

import hashlib
import re

import torch
import torch.fx as fx

from .collectives import gather_objects
from .errors import RankMismatchError


def fingerprint(gm: fx.GraphModule, example_inputs) -> dict:
    """What every rank must agree on, computed before the rank-specific rewrite."""
    inputs = [
        f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else repr(x)
        for x in example_inputs
    ]
    names = [re.sub(r"^L_(kwargs_)?|_$", "", node.target) for node in gm.graph.nodes if node.op == "placeholder"]
    return {"graph": hashlib.sha1(gm.code.encode()).hexdigest()[:12], "inputs": dict(zip(names, inputs))}


def checked_first_call(compiled, expected: dict, group, rank: int):
    checked = False

    def run(*args):
        nonlocal checked
        if not checked:
            _compare(gather_objects(expected, group), rank)
            checked = True
        return compiled(*args)

    return run


def _compare(seen: list[dict], rank: int) -> None:
    reference = seen[0]
    differing = [other for other, value in enumerate(seen) if value != reference]
    if not differing:
        return
    lines = []
    for name in reference["inputs"]:
        values = [value["inputs"].get(name) for value in seen]
        if len(set(values)) > 1:
            lines.append(f"  {name}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    if not lines:
        lines.append("  the captured graphs differ: " + ", ".join(f"rank {r} {v['graph']}" for r, v in enumerate(seen)))
    raise RankMismatchError(
        f"rank {rank}: the sequence-parallel ranks compiled different programs (ranks {differing} differ from "
        f"rank 0), so their collectives would not match:\n" + "\n".join(lines) + "\nEvery rank of the group "
        "must pass the same global batch (same shapes and dtypes) and run the same code; a data-parallel "
        "replica with its own batch belongs on the mesh's \"dp\" dim."
    )
