"""A script's own values on the live dashboard: ``hetps.torch.log_metrics(loss=..., ...)``.

Each call hands the values to this worker's live metrics meter, whose next report carries
them to the scheduler (docs/LIVE.md). Without the endpoint (no ``--metrics-port``) or before
the store exists, a call does nothing and returns False."""

from __future__ import annotations

from typing import Any

from hetps.metrics.reports import current_meter

__all__ = ["log_metrics"]


def log_metrics(step: int | None = None, **values: Any) -> bool:
    """Show ``values`` (``name=number``: floats, ints or 0-d tensors) on the live dashboard as
    this worker's, at ``step`` (default: the round the worker is in). Returns whether a meter
    took them. A name must be a letter or ``_`` and up to 31 letters, digits, ``_`` or ``.``;
    a value must be finite; at most 16 names per worker: ValueError says which is wrong."""
    meter = current_meter()
    if meter is None:
        from hetps.metrics.reports import check_values

        check_values(values)  # bad input is an error with or without the endpoint
        return False
    meter.log_metrics(values, step)
    return True
