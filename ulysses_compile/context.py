"""What every pass receives: the group, this rank, the options, and the report being written."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .collectives import gather_parameter
from .options import Options
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
        """Parameters, buffers and ZeRO shards (inputs that only ``gather_parameter`` reads)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        found = set()
        for node, value in zip(placeholders, example_inputs):
            name = node.target
            if isinstance(value, torch.nn.Parameter) or "_parameters_" in name or "_buffers_" in name or (
                    node.users and all(user.target is gather_parameter for user in node.users)):
                found.add(node)
        return found
