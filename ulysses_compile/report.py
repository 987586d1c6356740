"""What the backend did to a graph: attention sites, placements that fell back, collectives inserted."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.fx as fx


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return re.sub(r"^L(\[[^\]]*\])+\.?", "", path)  # L['self'].model.layers.0 -> model.layers.0


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
    kind: str  # the ulysses_compile.collectives function
    node: str
    shape: tuple  # local input shape
    dtype: str


@dataclass
class Report:
    attention_sites: list = field(default_factory=list)
    rejected_attention: list[str] = field(default_factory=list)  # "module: why it is not parallelized"
    replicated: str = ""  # why the whole graph runs unsplit on every rank, if it does
    gathered_outputs: list[str] = field(default_factory=list)  # sharded graph outputs that are gathered
    fallbacks: list[Fallback] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    graphs: dict[str, str] = field(default_factory=dict)  # graph code after each pass

    def __str__(self) -> str:
        lines = [f"attention sites: {len(self.attention_sites)}"]
        if self.replicated:
            lines.append(f"runs replicated: {self.replicated}")
        lines += [f"  {site.summary()}" for site in self.attention_sites]
        lines += [f"  not parallelized: {reason}" for reason in self.rejected_attention]
        counts: dict[str, int] = {}
        for c in self.collectives:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        lines.append("collectives (forward): " + (", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"))
        lines += [f"gathered output: {line}" for line in self.gathered_outputs]
        lines.append(f"fallbacks: {len(self.fallbacks)}")
        lines += [f"  {f}" for f in self.fallbacks]
        return "\n".join(lines)
