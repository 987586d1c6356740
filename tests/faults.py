"""A deliberate bug, for tests of the checks against eager (``verify``): the all-to-all after each
attention replaced by a local stand-in of the same shape, so outputs are wrong while every shape holds."""

from __future__ import annotations

import contextlib

import ulysses_compile.passes.insert_all_to_all as insert_all_to_all


def skipped_heads_to_seq(x, seq_dim: int, head_dim: int, heads: int, rank: int, world_size: int, group_name: str):
    """This rank's sequence block of its own heads, repeated over the heads (even splits)."""
    block = x.shape[seq_dim] // world_size
    return x.narrow(seq_dim, rank * block, block).repeat_interleave(world_size, dim=head_dim)


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
