"""``options={"verify": True}``: check a compiled graph's first call against eager execution."""

from __future__ import annotations

import torch

from .errors import VerificationError

RTOL = 1e-4


def compare(name_pairs, rtol: float = RTOL) -> tuple[list[str], bool]:
    """Rows of a table (name, max abs error, error relative to the reference's magnitude) and a verdict."""
    rows, ok = [], True
    for name, got, want in name_pairs:
        if got.shape != want.shape:
            rows.append(f"{name:<40} shape {tuple(got.shape)} != {tuple(want.shape)}   MISMATCH")
            ok = False
            continue
        got64, want64 = got.detach().double(), want.detach().double()
        error = (got64 - want64).abs().max().item() if got.numel() else 0.0
        scale = want64.abs().max().item() if want.numel() else 0.0
        relative = error / scale if scale else error
        bad = not relative <= rtol
        ok = ok and not bad
        rows.append(f"{name:<40} max abs {error:.3e}   rel {relative:.3e}" + ("   MISMATCH" if bad else ""))
    return rows, ok


def verified(compiled, original, ctx):
    checked = False

    def run(*args):
        nonlocal checked
        result = compiled(*args)
        if not checked:
            checked = True
            with torch.no_grad():  # on copies: the graph may update buffers in place
                reference = original(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            pairs = [
                (f"output {i}", got, want)
                for i, (got, want) in enumerate(zip(_flat(result), _flat(reference)))
                if isinstance(got, torch.Tensor)
            ]
            rows, ok = compare(pairs)
            if not ok:
                raise VerificationError(
                    f"rank {ctx.rank}: the compiled graph disagrees with eager execution "
                    f"(rtol {RTOL} of the reference's magnitude):\n" + "\n".join(rows)
                )
        return result

    return run


def _flat(values):
    return list(values) if isinstance(values, (tuple, list)) else [values]
