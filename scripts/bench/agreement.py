"""Benchmarks compare implementations of the same math: a faster wrong answer is no result, so each
script checks that the sides agree and exits non-zero (after printing its table) when they do not."""

import math
from collections.abc import Iterable


def worst(relative_diffs: Iterable[float]) -> float:
    """The largest difference; NaN if any is NaN (max() keeps a NaN only when it comes first)."""
    values = list(relative_diffs)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def require_agreement(what: str, worst_relative_diff: float, rtol: float) -> str:
    """The line to print when `worst_relative_diff` <= rtol; exits with one error line otherwise (NaN too)."""
    if not worst_relative_diff <= rtol:
        raise SystemExit(f"error: {what} disagree: largest relative difference {worst_relative_diff:.2e} > {rtol:g}")
    return f"{what} agree within {worst_relative_diff:.1e} relative (checked <= {rtol:g})"
