"""ulysses_compile: ``torch.compile(model, backend="ulysses")`` runs DeepSpeed-Ulysses sequence
parallelism on an unmodified model, with eager-equal losses, outputs and gradients."""

from .backend import ulysses
from .data import SequenceParallelLoader
from .errors import (
    CollectiveError,
    DivisibilityError,
    InternalError,
    OptionsError,
    RankMismatchError,
    UlyssesError,
    UnsupportedError,
    VerificationError,
)
from .explain import explain
from .options import Options
from .report import Report
from .zero import full_state_dict, parallelize, save_pretrained

__all__ = [
    "CollectiveError",
    "DivisibilityError",
    "InternalError",
    "Options",
    "OptionsError",
    "RankMismatchError",
    "Report",
    "SequenceParallelLoader",
    "UlyssesError",
    "UnsupportedError",
    "VerificationError",
    "explain",
    "full_state_dict",
    "parallelize",
    "save_pretrained",
    "ulysses",
]
