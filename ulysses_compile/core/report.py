"""What the backend did: per graph (``GraphReport``: attention sites, fallbacks, the collectives inserted,
the code after each pass) and, from ``explain``, per model (``Report``: adds the collectives of the
forward and backward programs with their bytes, graph breaks and the activations saved for backward)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx

from ulysses_compile.core.boundary import LazyLinear
from ulysses_compile.core.memory import StepMemory


def module_path(node: fx.Node) -> str:
    """The module a node belongs to (a backward node: the module of the forward op it derives from).
    Modules reached through a module-level global (``G[...]``: a kernel hub's wrapper of a function,
    transformers 5.25's rotary embedding) are passed over for the innermost module reached from the
    model."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    paths = [path for path, _cls in stack.values() if not path.startswith("G[")]
    if not paths:
        return ""
    return re.sub(r"^L(\[[^\]]*\])+\.?", "", paths[-1])  # L['self'].model.layers.0 -> model.layers.0


def layer_of(path: str) -> str | None:
    """The numbered layer a module path lies in (``model.layers.3.mlp.up_proj`` -> ``model.layers.3``),
    None outside any."""
    layer = re.match(r"(.*?\.\d+)(\.|$)", path)
    return layer.group(1) if layer else None


@dataclass
class Fallback:
    node: str
    op: str
    reason: str
    source: str  # the user's source line, from Dynamo's stack trace

    def __str__(self) -> str:
        return f"{self.node} ({self.op}): {self.reason}" + (f"\n    at {self.source}" if self.source else "")


@dataclass
class Collective:
    kind: str  # the ulysses_compile.core.collectives function
    node: str
    shape: tuple  # local input shape
    dtype: str


@dataclass
class GraphReport:
    attention_sites: list = field(default_factory=list)  # AttentionSite, from ulysses_compile/passes/detect_attention.py
    rejected_attention: list[str] = field(default_factory=list)  # "module: why it is not parallelized"
    replicated: str = ""  # why the whole graph runs unsplit on every rank, if it does
    gathered_outputs: list[str] = field(default_factory=list)  # sharded graph outputs that are gathered
    sharded_outputs: dict = field(default_factory=dict)  # output position -> boundary.SequenceBlocks, leaving sharded
    computed_outputs: dict[int, LazyLinear] = field(default_factory=dict)  # sharded output -> how it is computed
    fallbacks: list[Fallback] = field(default_factory=list)
    # causal convolutions run on the rank's block (module paths), with the rows before it
    convolutions: list[str] = field(default_factory=list)
    # regions whose ops run on another dim than the sequence (a chunked scan on the rank's heads): "module:
    # the values that went there by all-to-all"
    off_sequence: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the rewrite changed that the user should know
    replicated_draws: list[str] = field(default_factory=list)  # random draws read whole: the ranks' generators must agree
    collectives: list[Collective] = field(default_factory=list)
    # nodes whose code holds this rank's number (blocks of sizes that differ by rank): empty where the
    # group's ranks run one code
    rank_specific: list[str] = field(default_factory=list)
    # how the ranks hold the sequence (``plan_sequence_layout``): the ring's size in the head-tail layout,
    # 0 for contiguous blocks, and why
    head_tail: int = 0
    sequence_layout: str = ""
    pass_seconds: dict[str, float] = field(default_factory=dict)
    captured: str = ""  # the graph's code as Dynamo captured it
    graphs: dict[str, str] = field(default_factory=dict)  # graph code after each pass

    def __str__(self) -> str:
        lines = [f"attention sites: {len(self.attention_sites)}"]
        if self.replicated:
            lines.append(f"runs replicated: {self.replicated}")
        lines += [f"  {site.summary()}" for site in self.attention_sites]
        lines += [f"  not parallelized: {reason}" for reason in self.rejected_attention]
        if self.convolutions:
            lines.append(f"causal convolutions on the rank's block, with the rows before it: {len(self.convolutions)} "
                         f"({', '.join(self.convolutions[:3])}{' ...' if len(self.convolutions) > 3 else ''})")
        lines += [f"on the rank's part of another dim, whole along the sequence (by all-to-all): {line}"
                  for line in self.off_sequence]
        counts: dict[str, int] = {}
        for c in self.collectives:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        if self.sequence_layout:
            lines.append(f"sequence layout: {self.sequence_layout}")
        lines.append("collectives (forward): " + (", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"))
        lines += [f"gathered output: {line}" for line in self.gathered_outputs]
        lines += [f"sharded output: output {position} leaves sharded on dim {blocks.dim}" + (
                  f" as [{blocks.outer}, S, {blocks.inner}]" if (blocks.outer, blocks.inner) != (1, 1) else "")
                  for position, blocks in self.sharded_outputs.items()]
        if self.rank_specific:
            lines.append(f"rank-specific code: {len(self.rank_specific)} node(s) ({', '.join(self.rank_specific[:3])}"
                         f"{' ...' if len(self.rank_specific) > 3 else ''}): blocks of sizes that differ by rank, so "
                         f"the ranks' compiled code differs there")
        lines.append(f"fallbacks: {len(self.fallbacks)}")
        lines += [f"  {f}" for f in self.fallbacks]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass
class SiteReport:
    module: str
    form: str  # sdpa, matmul_softmax, flash_attn, ...
    layout: str  # e.g. [B, H, S, D]
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    kv_seq_len: int
    mask: str
    decision: str
    divisibility: str  # the verdicts on heads, KV heads and sequence at this P

    def __str__(self) -> str:
        return (f"{self.module}: {self.form} {self.layout}, heads {self.heads} (kv {self.kv_heads}), head_dim "
                f"{self.head_dim}, seq {self.seq_len}, mask {self.mask}\n    {self.decision}\n    {self.divisibility}")


@dataclass
class CollectiveCall:
    phase: str  # "forward" or "backward"
    kind: str  # all_to_all, all_gather, reduce_scatter, all_reduce, ring (a ring attention's sends)
    purpose: str  # the ulysses_compile.core.collectives function it implements (seq_to_heads, sync_grad, ...)
    where: str  # the module it serves
    shape: tuple  # this rank's input
    dtype: str
    bytes: int  # of this rank's input

    def __str__(self) -> str:
        return (f"{self.phase:<8} {self.kind:<14} {self.purpose or '-':<22} {str(list(self.shape)):<18} "
                f"{self.dtype:<8} {self.bytes:>12,}  {self.where}")


@dataclass
class Report:
    """What ``explain`` found, for rank ``rank`` of ``world_size``."""

    world_size: int
    rank: int
    graphs: list[GraphReport] = field(default_factory=list)
    attention_sites: list[SiteReport] = field(default_factory=list)
    rejected_attention: list[str] = field(default_factory=list)
    collectives: list[CollectiveCall] = field(default_factory=list)
    calls_under_inductor: Counter = field(default_factory=Counter)  # (phase, kind) -> calls once bucketed
    fallbacks: list[Fallback] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)
    ulysses_minimum_bytes: int = 0  # the sites' q, k, v, output all-to-alls, forward and backward
    ring_minimum_bytes: int = 0  # what the rank must receive round the rings of the sites planned with one
    memory: StepMemory | None = None  # the per-rank memory estimate of a training step
    # the index in ``graphs`` of each graph run, in order: a graph Dynamo reuses for every layer after a
    # graph break runs once per layer, and the sites, collectives and memory above count every run
    runs: list[int] = field(default_factory=list)

    def totals(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(phase, kind) -> (calls, bytes)."""
        totals: dict[tuple[str, str], tuple[int, int]] = {}
        for call in self.collectives:
            calls, size = totals.get((call.phase, call.kind), (0, 0))
            totals[(call.phase, call.kind)] = (calls + 1, size + call.bytes)
        return totals

    def all_to_all_bytes(self) -> int:
        return sum(call.bytes for call in self.collectives if call.kind == "all_to_all")

    def __str__(self) -> str:
        lines = [f"ulysses_compile at P = {self.world_size} (rank {self.rank}): {len(self.graphs)} graph(s), "
                 f"{len(self.graph_breaks)} graph break reason(s)"]
        reused = {index: self.runs.count(index) for index in sorted(set(self.runs)) if self.runs.count(index) > 1}
        lines += [f"  graph {index} runs {count} times (Dynamo reuses it after a graph break); each run is counted"
                  for index, count in reused.items()]
        lines += [f"  graph break: {reason}" for reason in self.graph_breaks]
        lines += [f"  graph {i} runs replicated: {graph.replicated}" for i, graph in enumerate(self.graphs)
                  if graph.replicated]
        lines += [f"  graph {i} sequence layout: {graph.sequence_layout}" for i, graph in enumerate(self.graphs)
                  if graph.sequence_layout]
        lines += [f"  graph {i} causal convolution on the rank's block, with the rows before it: {module}"
                  for i, graph in enumerate(self.graphs) for module in graph.convolutions]
        lines += [f"  graph {i} on the rank's part of another dim, whole along the sequence: {line}"
                  for i, graph in enumerate(self.graphs) for line in graph.off_sequence]
        lines.append(f"\nattention sites: {len(self.attention_sites)}")
        lines += [f"  {site}" for site in self.attention_sites]
        lines += [f"  not parallelized: {reason}" for reason in self.rejected_attention]
        lines.append(f"\ncollectives per step (this rank's input bytes): {len(self.collectives)} calls, "
                     f"{self.calls_under_inductor.total()} once Inductor buckets them (in brackets)")
        lines += [f"  {phase:<8} {kind:<14} x{calls:<4} ({self.calls_under_inductor[phase, kind]:>3}) {size:>14,} B"
                  for (phase, kind), (calls, size) in sorted(self.totals().items())]
        if self.ulysses_minimum_bytes:
            ratio = self.all_to_all_bytes() / self.ulysses_minimum_bytes
            lines.append(f"  all-to-all {self.all_to_all_bytes():,} B against the Ulysses minimum "
                         f"{self.ulysses_minimum_bytes:,} B (B x S/P x (2H + 2H_kv) x D per site and "
                         f"direction, at this rank's block sizes): {ratio:.2f}x")
        ring_bytes = sum(call.bytes for call in self.collectives if call.kind == "ring")
        if self.ring_minimum_bytes:
            lines.append(f"  ring {ring_bytes:,} B sent against the minimum {self.ring_minimum_bytes:,} B ((R - 1) "
                         f"key/value blocks forward, twice that backward): {ring_bytes / self.ring_minimum_bytes:.2f}x")
        lines.append(f"  {'phase':<8} {'kind':<14} {'purpose':<22} {'shape':<18} {'dtype':<8} {'bytes':>12}  where")
        lines += [f"  {call}" for call in self.collectives]
        lines.append(f"\nfallbacks: {len(self.fallbacks)}")
        lines += [f"  {fallback}" for fallback in self.fallbacks]
        if self.memory is not None:
            lines.append(f"\nmemory per rank of a training step, estimated ({self.memory.optimizer_states} optimizer "
                         f"state(s) per parameter):\n{self.memory.at()}")
        return "\n".join(lines)
