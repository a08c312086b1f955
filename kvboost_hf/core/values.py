"""Type checks of setting values that every settings class shares (NumPy's scalars count as numbers, bools do not)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import cast

from kvboost_hf.core.errors import ConfigError


def is_integer(value: object) -> bool:
    """An integer (NumPy's included), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite(value: object) -> bool:
    """A real number (NumPy's included), not a bool, neither infinite nor NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_bounds(owner: str, fields: Iterable[tuple[str, object, float, bool]]) -> None:
    """Raise :class:`~kvboost_hf.core.errors.ConfigError` naming the first of ``fields`` (``(name, value, bound,
    strict)``) whose value is not a finite number above (``strict``) or at least its bound; a value None (a
    setting's "none") passes."""
    for name, value, bound, strict in fields:
        if value is None:
            continue
        number = cast(float, value) if is_finite(value) else math.nan  # NaN fails both comparisons
        if not (number > bound if strict else number >= bound):
            raise ConfigError(f"{owner}.{name} must be a number {'>' if strict else '>='} {bound:g}, got {value!r}")
