"""Every error this package raises on purpose is a :class:`UlyssesError`."""

import re

import torch.distributed as dist

# How torch.distributed's backends word a failed collective (gloo raises plain RuntimeErrors).
_COLLECTIVE_FAILURE = re.compile(
    r"gloo|nccl|timed out|timeout|pair closure|connection (closed|reset)|process group|broken pipe", re.I)


def is_collective_failure(error: BaseException) -> bool:
    """Whether a torch error is a collective that did not complete (not one of ours)."""
    return not isinstance(error, UlyssesError) and (
        isinstance(error, dist.DistError) or bool(_COLLECTIVE_FAILURE.search(str(error))))


class UlyssesError(RuntimeError):
    """Base class: the message names what was found, where, what was expected and what to do."""


class OptionsError(UlyssesError, ValueError):
    """An option passed through ``torch.compile(..., options=...)`` is unknown or has a wrong value."""


class DivisibilityError(UlyssesError):
    """The heads of an attention cannot be split over the sequence-parallel ranks (fewer heads than ranks)."""


class UnsupportedError(UlyssesError):
    """The model uses something this version cannot parallelize exactly; the message says what to do."""


class VerificationError(UlyssesError):
    """``options={"verify": True}`` found the compiled program disagreeing with eager execution."""


class InternalError(UlyssesError):
    """A self-check of the rewrite failed; this is a bug in ulysses_compile, please report it."""


class RankMismatchError(UlyssesError):
    """The ranks of a sequence-parallel group compiled different programs (other shapes or code)."""


class CollectiveError(UlyssesError):
    """A collective of a compiled graph did not complete: its process group is gone, or another rank
    failed, stopped or is stuck, and the group's timeout ran out."""
