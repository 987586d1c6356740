"""Re-run the rewritten graph on fake tensors and check every value has the local shape its placement
implies; a mismatch is a bug in a rule and stops compilation instead of computing a wrong answer.

Before: a rewritten graph whose nodes carry global example values. After: the same graph, every node's
``meta["val"]`` / ``meta["example_value"]`` holding its local fake value (what Inductor reads).

It changes no code (``tests/test_pass_goldens.py::test_check_local_shapes_changes_nothing``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ulysses_compile.core.compat import FakeTensor, FakeTensorMode, FakeTensorProp, free_unbacked_symbols
from ulysses_compile.core.errors import InternalError
from ulysses_compile.core.sharding import describe, local_shape, sharding_of
from ulysses_compile.core.sizes import agree, same_size


def check_local_shapes(gm: fx.GraphModule, ctx) -> None:
    gm.graph.lint()
    gm.recompile()
    # The placeholders' example values are Dynamo's fake inputs, with symbolic sizes where the graph
    # is dynamic; faking the real example inputs again would fix those sizes to this call's. Their mode
    # is also found inside tensor subclasses (a graph whose inputs are all lazy blocks from the last one).
    fake_inputs = [node.meta["example_value"] for node in gm.graph.find_nodes(op="placeholder")]
    mode = _fake_mode_of(fake_inputs) or FakeTensorMode()
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
    for node in gm.graph.nodes:
        sharding = sharding_of(node)
        local = node.meta.get("val")
        node.meta["example_value"] = local
        if (
            sharding is None
            or sharding.output is None
            or isinstance(sharding.output, tuple)
            or not isinstance(local, torch.Tensor)
            or not isinstance(sharding.global_value, torch.Tensor)
        ):
            continue
        expected = local_shape(sharding.global_value.shape, sharding.output, ctx.world_size, ctx.rank)
        if len(local.shape) != len(expected) or not all(map(_equal, local.shape, expected)):
            raise InternalError(
                f"node {node.name} ({node.target}) has local shape {tuple(local.shape)} but placement "
                f"{describe(sharding.output)} of global shape {tuple(sharding.global_value.shape)} "
                f"implies {expected}"
            )


def _fake_mode_of(values) -> FakeTensorMode | None:
    for value in values:
        if isinstance(value, FakeTensor):
            return value.fake_mode
        if hasattr(value, "__tensor_flatten__"):  # a subclass (GatheredOnUse): its inner tensors are fake
            found = _fake_mode_of([getattr(value, name) for name in value.__tensor_flatten__()[0]])
            if found is not None:
                return found
    return None


def _equal(size, expected) -> bool:
    """Equal by the shape environment's facts (a ``torch._check`` relating two symbols), or at this
    call's sizes and the next ones. A size read from data (a rank's own count of rows, an unbacked
    symbol) has no value a placement implies: it is the rank's own."""
    if free_unbacked_symbols(size) or free_unbacked_symbols(expected):
        return True
    return same_size(size, expected) or agree(size, expected)
