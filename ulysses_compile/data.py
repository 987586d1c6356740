"""Per-rank data streams for a sequence-parallel group.

A compiled model expects every rank of its sequence group to pass the same batch (it cuts each rank's
block out of it). Loaders written for data parallelism (a ``DistributedSampler``, accelerate, HF
Trainer) hand each rank its own batch instead. :class:`SequenceParallelLoader` turns the second into the
first, as ALST's ``UlyssesSPDataLoaderAdapter`` does: each time the ranks draw a batch from their own
loader, they exchange them, and every rank yields the group's P batches in rank order. The whole group
then trains on each of them in turn, so one optimizer step over ``accumulation_steps`` micro-batches
equals a DDP step over the same P batches (their mean loss). On a ``("dp", "sp")`` mesh the exchange
runs within each sequence group, and the data-parallel average spans the replicas as before.

A rank whose loader ends before its peers' would leave them waiting in the next exchange, and a step
of fewer batches than its peers' would be silently unequal, so ranks that run out at different draws
get a :class:`RankMismatchError` on every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from ulysses_compile.core.collectives import gather_objects
from ulysses_compile.core.compat import tree_leaves, tree_map
from ulysses_compile.core.errors import OptionsError, RankMismatchError
from ulysses_compile.core.options import Options


class _Ended:
    """What a rank whose loader is exhausted contributes to the exchange."""


class SequenceParallelLoader:
    """Wrap this rank's ``loader`` (any iterable of batches); iterate to get the sequence group's batches
    one by one, each on every rank of the group. Give the same ``group`` or ``mesh`` as to the model.
    Divide each micro-batch's loss by ``accumulation_steps`` and step the optimizer after that many."""

    def __init__(self, loader, *, group=None, mesh=None):
        self.loader = loader
        self.group = Options.parse({"group": group, "mesh": mesh}).process_group()
        if self.group is None:
            raise OptionsError("SequenceParallelLoader: torch.distributed is not initialized; call "
                               "init_process_group first (under torchrun) or iterate the loader itself")

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per draw of the wrapped loader: the sequence group's size."""
        return self.group.size()

    def __len__(self) -> int:
        return len(self.loader) * self.accumulation_steps

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_sampler(self):
        return getattr(self.loader, "batch_sampler", None)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the wrapped loader (accelerate's) or its sampler (a ``DistributedSampler``), which
        reshuffle per epoch."""
        target = self.loader if hasattr(self.loader, "set_epoch") else getattr(self.loader, "sampler", None)
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)

    def __iter__(self):
        mine = iter(self.loader)
        for draw in itertools.count():
            batch = next(mine, _Ended())
            if isinstance(batch, Mapping) and not isinstance(batch, dict):
                batch = dict(batch)  # a tokenizer's BatchEncoding, which pytree does not open
            device = next((leaf.device for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)), None)
            # as CPU tensors: a GPU tensor would be unpickled on the sender's device
            batches = gather_objects(tree_map(lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf,
                                              batch), self.group)
            ended = [rank for rank, theirs in enumerate(batches) if isinstance(theirs, _Ended)]
            if len(ended) == len(batches):
                return
            if ended:
                raise RankMismatchError(
                    f"SequenceParallelLoader: the loaders of sequence-group ranks {ended} ended after {draw} "
                    f"batch(es) while the others' went on; give every rank the same number of batches (a "
                    f"DistributedSampler does, drop_last=True on a ragged dataset)"
                )
            for theirs in batches:
                yield tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, theirs)
