"""ulysses_compile: ``torch.compile(model, backend="ulysses")`` runs DeepSpeed-Ulysses sequence
parallelism on an unmodified model, with eager-equal losses, outputs and gradients."""

from ulysses_compile.backend import ulysses
from ulysses_compile.core.errors import (
    CollectiveError,
    DivisibilityError,
    InternalError,
    OptionsError,
    RankMismatchError,
    UlyssesError,
    UnsupportedError,
    VerificationError,
)
from ulysses_compile.core.options import Options
from ulysses_compile.core.report import Report
from ulysses_compile.data import SequenceParallelLoader
from ulysses_compile.explain import explain, explain_generation
from ulysses_compile.zero import full_state_dict, parallelize, save_pretrained

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
    "explain_generation",
    "full_state_dict",
    "parallelize",
    "save_pretrained",
    "ulysses",
]
