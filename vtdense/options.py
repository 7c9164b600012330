"""Range checks of numeric options, each one ``ValueError`` that names the option and the value.

The tasks, the model builders and the optimiser helpers check their numbers when they are made,
before a run starts (a bad value would otherwise fail deep inside the first step, or train wrongly
without a word). The message reads ``"<name> must be <what> (option '<name>'), got <value>"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["check_int", "check_number", "positive_list"]


def check_int(name: str, value: Any, *, low: int = 1, optional: bool = False) -> None:
    """``value`` a whole number (``bool`` excluded) of at least ``low``, or ``None`` when
    ``optional``; else one ``ValueError`` naming the option ``name``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive int" if low == 1 else f"a whole number >= {low}"
        raise ValueError(f"{name} must be {what}{' or None' if optional else ''} (option '{name}'), got {value!r}")


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, optional: bool = False) -> None:
    """``value`` a finite number (``bool`` excluded) within ``[low, high]`` (a bound left out:
    none on that side; ``low_open`` / ``high_open``: that end excluded), or ``None`` when
    ``optional``; else one ``ValueError`` naming the option ``name``."""
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or value > low or (not low_open and value == low))
    ok = ok and (high is None or value < high or (not high_open and value == high))
    if not ok:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        raise ValueError(f"{name} must be a number in {lo}, {hi}{' or None' if optional else ''} (option '{name}'), "
                         f"got {value!r}")


def positive_list(value: Any, option: str, *, integers: bool, example: str) -> tuple[Any, ...] | None:
    """``value`` as a tuple of positive finite numbers (whole ones with ``integers``), or ``None``.

    Raises:
        ValueError: ``value`` is not a non-empty list of such numbers: ``"<option> must be a non-empty
            list of positive ints|numbers, e.g. <example>, or null, got <value>"``.
    """
    if value is None:
        return None
    kinds = (int,) if integers else (int, float)
    ok = (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and len(value) > 0
        and all(isinstance(v, kinds) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value)
    )
    if not ok:
        what = "positive ints" if integers else "positive numbers"
        raise ValueError(f"{option} must be a non-empty list of {what}, e.g. {example}, or null, got {value!r}")
    return tuple(int(v) if integers else float(v) for v in value)
