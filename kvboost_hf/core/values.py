"""Type checks of setting values that every settings class shares (NumPy's scalars count as numbers, bools do not)."""

from __future__ import annotations

import math
import numbers


def is_integer(value: object) -> bool:
    """An integer (NumPy's included), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite(value: object) -> bool:
    """A real number (NumPy's included), not a bool, neither infinite nor NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
