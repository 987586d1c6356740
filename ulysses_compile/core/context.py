"""What every pass receives and none changes: the group (by one name on every rank), this rank's number
(a graph holds it only where its blocks differ by rank; ``rank_for`` otherwise gives the rank read at run
time), the options, the parameters."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from ulysses_compile.core.boundary import own_blocks
from ulysses_compile.core.collectives import rank_node
from ulysses_compile.core.options import Options
from ulysses_compile.core.sharding import SHARDS, Placement, RingShard, Shard, seq_shard


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
    # placeholders holding a graph's sequence-sharded output left lazily (``boundary.GatheredOnUse``) ->
    # its placement: this rank's block is there without a gather
    lazy_inputs: dict[fx.Node, Placement] = field(default_factory=dict)
    # the layouts those blocks are in (``head_tail``, 0 for contiguous blocks)
    lazy_head_tail: frozenset[int] = frozenset()
    # Inside an attention planned as Ulysses x ring: the ring's size, the group and the rank then being
    # the rank's Ulysses group and its place in it (``within_ulysses``)
    ring: int = 1
    # The ring's size R where the ranks hold the sequence in the head-tail layout (each ring place i
    # the chunks i and 2R - 1 - i of 2R: ``plan_sequence_layout``), 0 for contiguous blocks
    head_tail: int = 0

    def within_ulysses(self, ulysses: int, group_name: str) -> "PassContext":
        """The context of an attention whose heads split over this rank's Ulysses group of ``ulysses``
        consecutive ranks (``group_name``), a ring running over the groups."""
        return replace(self, world_size=ulysses, rank=self.rank % ulysses, group_name=group_name,
                       ring=self.world_size // ulysses, head_tail=0)

    def layout_args(self) -> tuple:
        """The trailing argument a call that takes or gathers sequence blocks gets in a head-tail layout
        (none in the contiguous one, whose calls keep their defaults)."""
        return (self.head_tail,) if self.head_tail else ()

    def heads_shard(self, dim: int) -> Placement:
        """The placement of a whole-sequence value narrowed to this rank's heads along ``dim``."""
        return Shard(dim) if self.ring == 1 else RingShard(dim, self.world_size)

    def rank_for(self, graph: fx.Graph, *lengths) -> fx.Node | int:
        """The rank as ``graph`` passes it to a call whose blocks are of ``lengths``: read at run time
        where those are split in blocks of one size (the group's ranks then run one code), else this
        rank's number, as its blocks' sizes, and so its code, differ from another rank's."""
        if all(isinstance(length, int) and length % self.world_size == 0 for length in lengths):
            return rank_node(graph, self.group_name)
        return self.rank

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

    @staticmethod
    def lazy_placeholders(gm: fx.GraphModule, example_inputs, group, group_name: str) \
            -> tuple[dict[fx.Node, Placement], frozenset[int]]:
        """The placeholders whose value is a sequence-sharded output of a graph of this group, left
        lazily and not read yet, with their placement; and the layouts of their blocks."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        found, layouts = {}, set()
        for node, value in zip(placeholders, example_inputs):
            factors = own_blocks(value, group.rank(), group.size(), group_name)
            if factors is not None:
                found[node] = seq_shard(*factors[:3])
                layouts.add(factors[3])
        return found, frozenset(layouts)
