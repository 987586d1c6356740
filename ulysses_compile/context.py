"""What every pass receives and none changes: the group, this rank, the options, the parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .options import Options
from .sharding import SHARDS


@dataclass(frozen=True)
class PassContext:
    world_size: int
    rank: int
    group_name: str
    options: Options
    parameters: frozenset[fx.Node]  # placeholders holding parameters, buffers and ZeRO shards
    data_parallel: tuple[str, int] | None = None  # (group name, replicas) of the mesh's "dp" dim
    outputs_to_caller: bool = False  # the graph's outputs go straight to the torch.compile caller (compat)
    graph_break: str = ""  # why Dynamo ended the graph at a graph break, "" at a return (compat)
    checkpointed_side_effect_break: str = ""  # a graph break Dynamo recorded inside a checkpointed region (compat)

    @staticmethod
    def parameter_placeholders(gm: fx.GraphModule, example_inputs) -> frozenset[fx.Node]:
        """Parameters, buffers and ZeRO shards, told by Dynamo's name of their source, which is the same
        on every rank (whether a shard is an ``nn.Parameter`` view or a padded copy is not)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        found = set()
        for node, value in zip(placeholders, example_inputs):
            name = node.target
            if isinstance(value, torch.nn.Parameter) or any(
                    source in name for source in ("_parameters_", "_buffers_", f"_dict{SHARDS}_")):
                found.add(node)
        return frozenset(found)
