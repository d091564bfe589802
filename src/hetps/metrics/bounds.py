"""The bounds of a metrics report and the checks that hold a report's values to them: a
report the scheduler refuses raises :class:`ReportError`, whose message names what is
wrong (the worker's and server's reports, :mod:`hetps.metrics.reports`, and the machine's
part of them, :mod:`hetps.metrics.sysinfo`)."""

from __future__ import annotations

import math
from typing import Any

MAX_COUNT = 1 << 53  # exact in a float, as Prometheus reads it
MAX_SECONDS, MAX_T = 1e12, 1e10


class ReportError(ValueError):
    """A metrics report the scheduler refuses; the message says what is wrong with it."""


def checked_int(value: Any, what: str, low: int = 0, high: int = MAX_COUNT) -> int:
    """``value``, an integer from ``low`` to ``high``; else :class:`ReportError` names ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ReportError(f"{what} must be an integer from {low} to {high}, not {show(value)}")
    return value


def checked_seconds(value: Any, what: str, high: float = MAX_SECONDS) -> float:
    """``value``, seconds from 0 to ``high``; else :class:`ReportError` names ``what``."""
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 <= value <= high
    ):
        raise ReportError(
            f"{what} must be a number of seconds from 0 to {high:g}, not {show(value)}"
        )
    return float(value)


def show(value: Any) -> str:
    """``value`` as a refusal quotes it (cut to 60 characters)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
