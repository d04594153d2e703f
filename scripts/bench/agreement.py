"""Benchmarks compare implementations of the same math: a faster wrong answer is no result, so each
script checks that the sides agree and exits non-zero (after printing its table) when they do not."""


def require_agreement(what: str, worst_relative_diff: float, rtol: float) -> str:
    """The line to print when `worst_relative_diff` <= rtol; exits with one error line otherwise (NaN too)."""
    if not worst_relative_diff <= rtol:
        raise SystemExit(f"error: {what} disagree: largest relative difference {worst_relative_diff:.2e} > {rtol:g}")
    return f"{what} agree within {worst_relative_diff:.1e} relative (checked <= {rtol:g})"
