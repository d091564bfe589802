"""A worker's balance report as arrays (pure): its link samples and its servers' times, read
in bulk by the planner (:mod:`hetps.balance.service`). The balance agent sends both as
float64 arrays (the report's arrays 0 and 1); a report may also list them in its body
(``samples``, ``server_times``: a script of its own), which reads the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["SAMPLE_COLUMNS", "sample_array", "times_array"]

#: columns of a report's sample array: src, dst (node ids), bytes, t0, t1, kind
SAMPLE_COLUMNS = 6
#: columns of its times array: server rank, bytes, seconds (of the last round)
TIME_COLUMNS = 3


def _array(a: object, cols: int, max_rows: int, what: str) -> np.ndarray | str:
    a = np.asarray(a)
    if a.dtype != np.float64 or a.ndim != 2 or a.shape[1] != cols:
        return f"balance report: {what} must be a float64 array of {cols} columns, got {a.dtype} {a.shape}"
    if a.shape[0] > max_rows:
        return f"balance report: {a.shape[0]} {what}, more than {max_rows}"
    return a


def sample_array(arrays: Sequence, listed: Sequence, max_rows: int) -> np.ndarray | str:
    """A report's link samples as one float64 array (rows src, dst, bytes, t0, t1, kind):
    the report's array (how the balance agent sends them), or its listed samples (5 or 6
    numbers each, kind 0 when left out). A string says what is wrong instead."""
    if arrays:
        return _array(arrays[0], SAMPLE_COLUMNS, max_rows, "samples")
    if not listed:
        return np.zeros((0, SAMPLE_COLUMNS))
    out = np.zeros((len(listed), SAMPLE_COLUMNS))
    for i, item in enumerate(listed):  # (a report from a script of its own: lists)
        out[i, : len(item)] = item[:SAMPLE_COLUMNS]
    return out


def times_array(
    arrays: Sequence, listed: Mapping[str, Sequence[float]], max_rows: int
) -> np.ndarray | str:
    """A report's times per server as one float64 array (rows: server rank, bytes, seconds):
    the report's second array, or its ``server_times`` map. A string says what is wrong."""
    if len(arrays) > 1:
        return _array(arrays[1], TIME_COLUMNS, max_rows, "server times")
    out = np.zeros((len(listed), TIME_COLUMNS))
    for i, (rank, (nbytes, secs)) in enumerate(listed.items()):
        out[i] = (int(rank), nbytes, secs)
    return out
