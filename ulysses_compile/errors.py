"""Every error this package raises on purpose is a :class:`UlyssesError`."""


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
