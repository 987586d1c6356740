"""Placements of graph values over the sequence-parallel ranks, kept in one typed ``node.meta`` entry.

A value is ``Replicate()`` (every rank holds the whole global tensor), ``Shard(d)`` (rank r holds the
r-th of P balanced blocks of dim d: the sequence, or the heads inside attention), ``Partial()`` (the
global value is the sum of the ranks' values), ``PartialScan(d)`` (a cumulative sum along a sharded d,
each block short of the blocks before it) or ``MergedShard(d, outer, inner)``: dim d merges the
sequence with other dims, as ``[B, S, V] -> [B*S, V]`` does; viewed as ``[outer, S, inner]`` its S is
sharded, so a rank holds ``outer`` separate blocks. The sequence's blocks are in the graph's layout
(``PassContext.head_tail``): contiguous, or head-tail, where the r-th block holds two chunks of 2R
(``collectives.head_tail_positions``); the rules are the same in both, and the few that need contiguous
blocks keep the graph in them (``rules.contiguous_blocks_only``).

Mixture-of-experts layers sort their tokens by expert and put them back (ulysses_compile/passes/rules/routing.py).
Between, a rank holds ``PermutedShard(d, outer, inner, order)``: the rows of its block, permuted in an
order of its own (the local sort ``order``), which has no place in the global tensor until put back.
An index tensor whose values are this rank's positions into another value is ``Positions(rows, into)``.
No conversion exists for either; propagation only keeps them where the rows are put back in order.

Inside an attention that runs as a ring (Ulysses over U ranks, a ring over P / U), q, k, v and the
output are ``RingShard``: a block of the heads over the Ulysses group and a chunk of the sequence over
the ring.

These are the passes' own types, not DTensor's. DTensor's ``Shard(d)`` means ``torch.chunk``'s blocks
(6 on 4 ranks: 2, 2, 2, 0); ours are balanced (2, 2, 1, 1), so no rank idles and none holds an empty
block. DTensor is for what users and torch see: ZeRO's parameters and gradients (``zero.py``, chunk
blocks as FSDP2 lays them out) and, with ``outputs="dtensor"``, model outputs (``boundary.py``): where P
divides the length both layouts are the same blocks, and where it does not a balanced block has no
DTensor placement and must be gathered or re-sliced first.

Every node of a rewritten graph carries a :class:`NodeSharding` (read with :func:`sharding_of`,
written only with :func:`place`): the node's global value, its output placement and the placement
each tensor argument must arrive in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.fx as fx

from ulysses_compile.core.sizes import as_int

_KEY = "ulysses_sharding"
# The node.meta entry of a node whose code a rule chose by this rank's number (its blocks' sizes differ).
RANK_SPECIFIC = "ulysses_rank_specific"


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial:
    """The global value is the sum of the ranks' values. ``over`` names a local sort when the rank's
    term counts the rows it permuted (per-expert token counts), which a grouped matmul over those very
    rows reads as they are."""

    over: str | None = None

    def __repr__(self) -> str:
        return f"Partial(over={self.over})" if self.over else "Partial()"


@dataclass(frozen=True)
class Shard:
    """Rank r holds the r-th balanced block of dim ``dim`` (``block_sizes``)."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class PartialScan:
    """Rank r holds the r-th block of a cumulative sum along ``dim``, short of the totals of the blocks
    before it: ``Shard(dim)`` once those are added."""

    dim: int

    def __repr__(self) -> str:
        return f"PartialScan(dim={self.dim})"


@dataclass(frozen=True)
class MergedShard:
    dim: int
    outer: int
    inner: int

    def __repr__(self) -> str:
        return f"MergedShard(dim={self.dim}, outer={self.outer}, inner={self.inner})"

    def __hash__(self) -> int:  # outer/inner may be SymInts (a dynamic batch), which do not hash
        return hash((self.dim, str(self.outer), str(self.inner)))


@dataclass(frozen=True)
class PermutedShard:
    """The rows rank r holds under ``seq_shard(dim, outer, inner)``, permuted by the local sort named
    ``order``: as many rows as that block, in an order no other rank shares."""

    dim: int
    outer: int
    inner: int
    order: str

    def __repr__(self) -> str:
        return f"PermutedShard(dim={self.dim}, outer={self.outer}, inner={self.inner}, order={self.order})"

    def __hash__(self) -> int:
        return hash((self.dim, str(self.outer), str(self.inner), self.order))


@dataclass(frozen=True)
class RingShard:
    """Inside an attention planned as Ulysses over ``ulysses`` ranks and a ring over the others: rank
    r = i * ulysses + u holds the u-th of ``ulysses`` balanced blocks of dim ``heads`` and, where ``seq``
    is a dim, the i-th of P / ``ulysses`` blocks of dim ``seq`` in the graph's layout (its Ulysses group's
    chunk of the sequence: contiguous, or chunks i and 2R - 1 - i of 2R head-tail)."""

    heads: int
    ulysses: int
    seq: int | None = None

    def __repr__(self) -> str:
        return f"RingShard(heads={self.heads}, ulysses={self.ulysses}, seq={self.seq})"


@dataclass(frozen=True)
class Positions:
    """An index tensor laid out as ``rows`` whose values are this rank's own positions along the
    sharded dim of a value laid out as ``into`` (a local sort's indices, or their inverse)."""

    rows: "Placement"
    into: "Placement"

    def __repr__(self) -> str:
        return f"Positions(rows={self.rows!r}, into={self.into!r})"


Placement = Union[Replicate, Shard, Partial, PartialScan, MergedShard, PermutedShard, Positions, RingShard]
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


def block_range(length: int, world_size: int, rank) -> tuple:
    """``(start, size)`` of rank ``rank``'s block. A ``rank`` read at run time (a tensor) gives a tensor
    start; it is passed only where the blocks are of one size (``PassContext.rank_for``)."""
    if isinstance(rank, torch.Tensor):
        size = length // world_size
        return rank * size, size
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
    return is_sharded(placement) or isinstance(placement, (Partial, PartialScan, PermutedShard, Positions, RingShard))


def is_permuted(placement: OutputPlacement) -> bool:
    """True for rows in a rank's own order, or positions into them: values with no global layout."""
    if isinstance(placement, tuple):
        return any(is_permuted(p) for p in placement)
    return isinstance(placement, (PermutedShard, Positions)) or isinstance(placement, Partial) and bool(placement.over)


def sort_orders(placement: OutputPlacement) -> set[str]:
    """The local sorts a value's placement depends on."""
    if isinstance(placement, tuple):
        return set().union(*map(sort_orders, placement)) if placement else set()
    if isinstance(placement, PermutedShard):
        return {placement.order}
    if isinstance(placement, Positions):
        return sort_orders(placement.rows) | sort_orders(placement.into)
    if isinstance(placement, Partial) and placement.over:
        return {placement.over}
    return set()


def completed(placement: Placement) -> Placement:
    """The placement of a value once its pending sums are done: ``Replicate`` for ``Partial``,
    ``Shard`` for ``PartialScan``."""
    if isinstance(placement, Partial):
        return REPLICATE
    if isinstance(placement, PartialScan):
        return Shard(placement.dim)
    return placement


def with_dim(placement: Placement, dim: int) -> Placement:
    """The same sequence sharding, on another tensor dim."""
    if isinstance(placement, PermutedShard):
        return PermutedShard(dim, placement.outer, placement.inner, placement.order)
    _, outer, inner = seq_factors(placement)
    return seq_shard(dim, outer, inner)


def local_shape(shape: torch.Size | tuple, placement: Placement, world_size: int, rank: int) -> tuple[int, ...]:
    if isinstance(placement, Positions):
        placement = placement.rows
    if isinstance(placement, PermutedShard):
        placement = seq_shard(placement.dim, placement.outer, placement.inner)
    shape = tuple(shape)
    if isinstance(placement, RingShard):
        local = list(shape)
        local[placement.heads] = block_range(shape[placement.heads], placement.ulysses, rank % placement.ulysses)[1]
        if placement.seq is not None:
            local[placement.seq] = block_range(shape[placement.seq], world_size // placement.ulysses,
                                               rank // placement.ulysses)[1]
        return tuple(local)
    factors = seq_factors(completed(placement))
    if factors is None:
        return shape
    dim, outer, inner = factors
    _, block = block_range(shape[dim] // (outer * inner), world_size, rank)
    return shape[:dim] + (outer * block * inner,) + shape[dim + 1 :]


@dataclass(frozen=True)
class NodeSharding:
    """What was decided for one node."""

    output: OutputPlacement
    global_value: Any  # the node's global example value (a FakeTensor, a tuple of them, or a constant)
    inputs: dict[fx.Node, Placement] = field(default_factory=dict)
    # How to turn the node's global computation into the local one, applied by ulysses_compile/passes/localize_ops.py.
    localize: Callable[[fx.Node, "NodeSharding", Any], None] | None = None  # (node, its sharding, the pass context)


def sharding_of(node: fx.Node) -> NodeSharding | None:
    return node.meta.get(_KEY)


def placed_as(node: fx.Node | None, placement: Placement) -> bool:
    """Whether ``node`` was placed, with its output in ``placement``."""
    sharding = sharding_of(node) if node is not None else None
    return sharding is not None and sharding.output == placement


def place(node: fx.Node, sharding: NodeSharding) -> fx.Node:
    """Record what was decided for ``node``: the one writer of placements. Propagation places the
    captured graph's nodes; a pass that inserts a node places it as it creates it."""
    node.meta[_KEY] = sharding
    return node


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
        return f"P({placement.over})" if placement.over else "P"
    if isinstance(placement, PermutedShard):
        return f"S~{placement.order}({placement.dim}|{placement.outer}x.x{placement.inner})"
    if isinstance(placement, Positions):
        return f"I[{describe(placement.rows)}->{describe(placement.into)}]"
    if isinstance(placement, PartialScan):
        return f"P+({placement.dim})"
    if isinstance(placement, RingShard):
        return f"S({placement.heads}/{placement.ulysses}" + (f", {placement.seq} ring)" if placement.seq is not None else ")")
    return "R"

