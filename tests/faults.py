"""A deliberate bug, for tests of the checks against eager (``verify``): the all-to-all after each
attention followed by a shift along the sequence, so outputs are wrong while every shape holds."""

from __future__ import annotations

import contextlib

import ulysses_compile.passes.insert_all_to_all as insert_all_to_all
from ulysses_compile.core.collectives import heads_to_seq


def skipped_heads_to_seq(x, seq_dim: int, head_dim: int, heads: int, rank: int, world_size: int, group_name: str):
    """The all-to-all's result rolled by one position along the sequence: the right shape, at any length
    (also a symbolic one), with the wrong token in every position."""
    return heads_to_seq(x, seq_dim, head_dim, heads, rank, world_size, group_name).roll(1, seq_dim)


def drop_output_all_to_all() -> None:
    """Every model compiled afterwards in this process gets the bug."""
    insert_all_to_all.heads_to_seq = skipped_heads_to_seq


@contextlib.contextmanager
def output_all_to_all_dropped():
    correct = insert_all_to_all.heads_to_seq
    drop_output_all_to_all()
    try:
        yield
    finally:
        insert_all_to_all.heads_to_seq = correct
