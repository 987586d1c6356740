"""ZeRO stage 3: gather each parameter again in the backward instead of keeping it from the forward.

Before (AOTAutograd would save ``weight``, the full parameter, for the backward)::

    weight = gather_parameter(shard, shape=(64, 64), group_name='0', group_size=2,
                              regather_in_backward=True)
    linear = torch._C._nn.linear(x, weight)

After: the same graph, the gather tagged ``recompute = MUST_RECOMPUTE``, in the checkpointed region of
its users where they have one. AOTAutograd copies the tag to the all-gather it traces, and its
partitioner then re-runs the gather in the backward where the weight is needed, so between its uses
the full parameter is freed and only the shard stays alive. (The partitioner saves a value tagged for
recomputation whose user lies in a later region: a gather tagged outside its layer's region would
stay whole from the forward to the backward.) Stages 1
and 2 (``regather_in_backward=False``) keep the gathered parameter: less traffic, more memory. Every
stage's gathers are also marked as ZeRO's, with their layer (``bucket_zero_gathers.tag_zero_gather``, in
``meta["custom"]``: a module path's numbered part, ``model.layers.3``, or the module's path), the mark by
which ``backend.bucketing`` has Inductor merge each layer's parameter all-gathers, and only those.

Pinned on a small model: ``tests/test_pass_goldens.py::test_regather_parameters``.
"""

from __future__ import annotations

import inspect

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ulysses_compile.core.collectives import gather_parameter
from ulysses_compile.core.compat import recompute_region, tag_recompute
from ulysses_compile.core.report import layer_of, module_path
from ulysses_compile.passes.bucket_zero_gathers import tag_zero_gather

_SIGNATURE = inspect.signature(gather_parameter)


def regather_parameters(gm: fx.GraphModule, ctx) -> None:
    for node in gm.graph.find_nodes(op="call_function", target=gather_parameter):
        path = module_path(node)
        tag_zero_gather(node, layer_of(path) or path or node.name)
        if _SIGNATURE.bind(*node.args, **node.kwargs).arguments.get("regather_in_backward", False):
            regions = [recompute_region(user) for user in node.users if recompute_region(user) is not None]
            tag_recompute(node, CheckpointPolicy.MUST_RECOMPUTE, max(regions, default=0))
