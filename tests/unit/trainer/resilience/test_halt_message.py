"""nan_policy=halt's line: where the non-finite gradient is, or that the norm overflowed though every
gradient is finite (a diverging run, not a NaN to look for)."""

import math

from trainer.resilience.nonfinite import halt_message


def test_the_line_names_the_unit_or_the_overflow():
    assert "the first non-finite gradient is in unit layers.3" in halt_message(7, 2.5, math.nan, "layers.3")
    overflow = halt_message(7, 2.5, math.inf, None)
    assert "every gradient is finite, but the fp32 sum of their squares overflows" in overflow
    assert overflow.startswith("step 7: loss 2.5, gradient norm inf")
    assert "overflows" not in halt_message(7, math.nan, 3.0, None)
