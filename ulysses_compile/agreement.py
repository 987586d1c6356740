"""Ranks that disagree or fail get an error, not a hang or a wrong answer. Every call of a compiled
graph goes through :func:`guarded`:

- on the first call, the ranks of the sequence-parallel group compare what they compiled (the captured
  graph and its input shapes and dtypes) with one small all-gather, before any collective of the graph
  runs. A rank fed another batch shape, or running other code, would otherwise enter collectives of
  other sizes or in another order than its peers and wait for them forever;
- a call after the graph's process group was destroyed is refused;
- a collective that fails in the forward (another rank died, or the group's timeout ran out because a
  rank raised or is stuck) becomes a :class:`CollectiveError` that says which rank and graph, the bound,
  and what to do. The backward's collectives run inside the autograd engine, where the process group's
  own error (e.g. gloo's "Timed out waiting 3000ms for recv operation") reaches ``loss.backward()``.
"""

from __future__ import annotations

import hashlib
import re

import torch
import torch.distributed as dist
import torch.fx as fx

from .collectives import gather_objects
from .compat import _resolve_process_group, process_group_timeout
from .errors import CollectiveError, RankMismatchError

# How torch.distributed's backends word a failed collective (gloo raises plain RuntimeErrors).
_COLLECTIVE_FAILURE = re.compile(r"gloo|nccl|timed out|connection (closed|reset)|process group|broken pipe", re.I)


def fingerprint(gm: fx.GraphModule, example_inputs) -> dict:
    """What every rank must agree on, computed before the rank-specific rewrite."""
    inputs = [
        f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else repr(x)
        for x in example_inputs
    ]
    return {"graph": hashlib.sha1(gm.code.encode()).hexdigest()[:12], "inputs": dict(zip(input_names(gm), inputs))}


def input_names(gm: fx.GraphModule) -> list[str]:
    """The graph's inputs as the user's code names them: ``input_ids``, ``model.embed_tokens.weight``
    (Dynamo's placeholder ``L_args_0_modules_model_modules_embed_tokens_parameters_weight_``)."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = re.sub(r"^L_(kwargs_|args_0_modules_|self_modules_)?|_$", "", node.target)
            names.append(re.sub(r"_(modules|parameters|buffers)_", ".", name))
    return names


def guarded(compiled, expected: dict, group, rank: int, graph_name: str):
    checked = False
    group_name, world_size, timeout = group.group_name, group.size(), process_group_timeout(group)

    def run(*args):
        nonlocal checked
        try:
            _resolve_process_group(group_name)
        except (RuntimeError, ValueError) as gone:
            raise CollectiveError(
                f"rank {rank}: {graph_name} was compiled for a process group of {world_size} ranks that has been "
                f"destroyed; call torch._dynamo.reset() after init_process_group and compile the model again"
            ) from gone
        try:
            if not checked:
                _compare(gather_objects(expected, group), rank)
                checked = True
            return compiled(*args)
        except RuntimeError as failure:
            if isinstance(failure, CollectiveError) or not (
                    isinstance(failure, dist.DistError) or _COLLECTIVE_FAILURE.search(str(failure))):
                raise
            raise CollectiveError(
                f"rank {rank}: a collective of {graph_name} over {world_size} sequence-parallel ranks did not "
                f"complete ({failure}). Another rank failed, was stopped or is stuck: look for its error "
                f"first. The wait is bounded by the process group's timeout ({timeout}): "
                f"init_process_group(timeout=...) or new_group(timeout=...)."
            ) from failure

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
