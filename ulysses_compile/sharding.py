"""Placements of graph values over the sequence-parallel ranks, kept in one typed ``node.meta`` key.

A value is ``Replicate()`` (every rank holds the whole global tensor), ``Shard(d)`` (rank r holds the
r-th of P contiguous blocks of dim d: the sequence, or the heads inside attention), ``Partial()`` (the global value is
the sum of the ranks' values) or ``MergedShard(d, outer, inner)``: dim d merges the sequence with
other dims, as ``[B, S, V] -> [B*S, V]`` does; viewed as ``[outer, S, inner]`` its S is sharded, so a
rank holds ``outer`` separate blocks. DTensor has no public placement for that last case.

Every node of a rewritten graph carries ``node.meta[PLACEMENT_KEY]``: a :class:`NodeSharding` with the
node's global shape, its output placement and the placement each tensor argument must arrive in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .sizes import as_int

PLACEMENT_KEY = "ulysses_sharding"


@dataclass(frozen=True)
class MergedShard:
    dim: int
    outer: int
    inner: int

    def __repr__(self) -> str:
        return f"MergedShard(dim={self.dim}, outer={self.outer}, inner={self.inner})"

    def __hash__(self) -> int:  # outer/inner may be SymInts (a dynamic batch), which do not hash
        return hash((self.dim, str(self.outer), str(self.inner)))


Placement = Union[Replicate, Shard, Partial, MergedShard]
# A node's output placement: one placement, None for a non-tensor value, or a tuple for tuple outputs.
OutputPlacement = Union[Placement, None, tuple]

REPLICATE = Replicate()
PARTIAL = Partial()


def block_sizes(length: int, world_size: int) -> list[int]:
    """The sizes of the P blocks of a sharded dim: balanced, the first ``length % P`` one larger
    (6 heads on 4 ranks: 2, 2, 1, 1). Unlike ``torch.chunk`` (2, 2, 2, 0), no rank idles."""
    # Closed form, no comparison: it also holds for a symbolic length without adding a guard.
    return [(length + world_size - 1 - rank) // world_size for rank in range(world_size)]


# The module.__dict__ entry where a ZeRO-partitioned module finds this call's local shards (zero.py).
SHARDS = "_ulysses_shards"


def shard_rows(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, size)`` of rank ``rank``'s rows of a ZeRO-sharded parameter: ``torch.chunk``'s blocks,
    the layout of DTensor's ``Shard(0)`` and FSDP2 (5 rows on 4 ranks: 2, 2, 1, 0). Parameters are
    DTensors that users and torch read, so they follow torch's meaning of ``Shard``; activations use
    the balanced ``block_sizes``."""
    chunk = -(-length // world_size)
    start = min(rank * chunk, length)
    return start, min(chunk, length - start)


def block_range(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, size)`` of rank ``rank``'s block."""
    sizes = block_sizes(length, world_size)
    return sum(sizes[:rank]), sizes[rank]


def seq_shard(dim: int, outer: int = 1, inner: int = 1) -> Placement:
    """The canonical placement for a sequence sharded inside dim ``dim`` as ``[outer, S, inner]``."""
    outer, inner = as_int(outer), as_int(inner)
    if outer == 1 and inner == 1:
        return Shard(dim)
    return MergedShard(dim, outer, inner)


def seq_factors(placement: Placement) -> tuple[int, int, int] | None:
    """``(dim, outer, inner)`` of a sequence-sharded placement, None for Replicate and Partial."""
    if isinstance(placement, Shard):
        return placement.dim, 1, 1
    if isinstance(placement, MergedShard):
        return placement.dim, placement.outer, placement.inner
    return None


def is_sharded(placement: OutputPlacement) -> bool:
    if isinstance(placement, tuple):
        return any(is_sharded(p) for p in placement)
    return seq_factors(placement) is not None


def is_rank_local(placement: OutputPlacement) -> bool:
    """True when ranks hold different values (sharded or partial), so gradients flowing back are too."""
    if isinstance(placement, tuple):
        return any(is_rank_local(p) for p in placement)
    return is_sharded(placement) or isinstance(placement, Partial)


def with_dim(placement: Placement, dim: int) -> Placement:
    """The same sequence sharding, on another tensor dim."""
    _, outer, inner = seq_factors(placement)
    return seq_shard(dim, outer, inner)


def local_shape(shape: torch.Size | tuple, placement: Placement, world_size: int, rank: int) -> tuple[int, ...]:
    factors = seq_factors(placement)
    shape = tuple(shape)
    if factors is None:
        return shape
    dim, outer, inner = factors
    _, block = block_range(shape[dim] // (outer * inner), world_size, rank)
    return shape[:dim] + (outer * block * inner,) + shape[dim + 1 :]


@dataclass
class NodeSharding:
    """What propagation decided for one node."""

    output: OutputPlacement
    global_value: Any  # the node's global example value (a FakeTensor, a tuple of them, or a constant)
    inputs: dict[fx.Node, Placement] = field(default_factory=dict)
    # How to turn the node's global computation into the local one, applied by passes/localize_ops.py.
    localize: Callable[[fx.Node, Any], None] | None = None
    fallback: str | None = None  # why the node was computed replicated instead of sharded


def sharding_of(node: fx.Node) -> NodeSharding | None:
    return node.meta.get(PLACEMENT_KEY)


def describe(placement: OutputPlacement) -> str:
    if placement is None:
        return "-"
    if isinstance(placement, tuple):
        return "(" + ", ".join(describe(p) for p in placement) + ")"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, MergedShard):
        return f"S({placement.dim}|{placement.outer}x.x{placement.inner})"
    if isinstance(placement, Partial):
        return "P"
    return "R"
