"""What every pass receives: the group, this rank, the options, and the report being written."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .options import Options
from .sharding import SHARDS
from .report import GraphReport


@dataclass
class PassContext:
    world_size: int
    rank: int
    group_name: str
    options: Options
    example_inputs: list
    report: GraphReport = field(default_factory=GraphReport)
    sites: list = field(default_factory=list)  # AttentionSite, from passes/detect_attention.py
    parameters: set[fx.Node] = field(default_factory=set)  # placeholders holding parameters/buffers
    seq_lengths: list = field(default_factory=list)  # attention sequence lengths, propagation may shard
    data_parallel: tuple[str, int] | None = None  # (group name, replicas) of the mesh's "dp" dim

    @staticmethod
    def parameter_placeholders(gm: fx.GraphModule, example_inputs) -> set[fx.Node]:
        """Parameters, buffers and ZeRO shards, told by Dynamo's name of their source, which is the same
        on every rank (whether a shard is an ``nn.Parameter`` view or a padded copy is not)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        found = set()
        for node, value in zip(placeholders, example_inputs):
            name = node.target
            if isinstance(value, torch.nn.Parameter) or any(
                    source in name for source in ("_parameters_", "_buffers_", f"_dict{SHARDS}_")):
                found.add(node)
        return found
