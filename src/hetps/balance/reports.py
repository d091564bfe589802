"""A worker's balance report as arrays (pure): its link samples and its servers' times, read
in bulk by the planner (:mod:`hetps.balance.service`). The balance agent sends both as
float64 arrays (the report's arrays 0 and 1); a report may also list them in its body
(``samples``, ``server_times``: a script of its own), which reads the same."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hetps.balance.plans import PLANS

__all__ = ["SAMPLE_COLUMNS", "host_ids", "listed", "sample_array", "spans", "times_array"]

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


def host_ids(
    nodes: Mapping, sender: int, host: Sequence[int] | None, rows: Sequence | None, arrays
) -> list[int] | str:
    """The workers a report stands for: its sender, or the workers a host's leader names
    (``host``: all of its host group, each once, ``rows`` giving each one's rows of the two
    arrays); a string says what is wrong instead."""
    if host is None:
        return [sender]
    group = getattr(nodes.get(sender), "group", -1)
    groups = [getattr(nodes.get(i), "group", -1) for i in host]
    if groups.count(group) != len(host) or group < 0 or len(set(host)) != len(host):
        bad = [i for i, g in zip(host, groups, strict=True) if g != group or group < 0]
        return f"balance report: a host's report names nodes {bad or list(host)} of no host {group}"
    rows = rows or []  # (pairs of counts: the body's declared type)
    have = [len(a) for a in arrays[:2]]
    sums = [sum(c) for c in zip(*rows, strict=True)] or [0, 0]
    if len(rows) != len(host) or len(have) != 2 or sums != have:
        return f"balance report: 'host_rows' {[list(r) for r in rows]} do not add up to the arrays' {have} rows"
    return list(host)


class RoundReports:
    """A round's reports until the planner answers it: every message (each answered once),
    and each report's samples and times as they came, each worker's rows read once. A
    worker's own report and its host's (a follower that dropped its leader sends both) carry
    the same rows of it, merged into the host's: the host's are read, whichever came first."""

    def __init__(self) -> None:
        self.msgs: dict[int, Any] = {}  # id -> message, in arrival order
        self.samples: list[tuple[np.ndarray, bool]] = []  # (samples, calibration)
        self.spans: list[tuple[np.ndarray, Any]] = []  # (times, host_rows)
        # every worker reported: its own report's entries (dropped if its host's comes), or
        # None where its host's report carries its rows
        self.rows: dict[int, list | None] = {}

    def take(self, msg: Any, ids: list[int], own: bool, sample: tuple, span: tuple) -> list | None:
        """Keep ``msg`` to answer and read its ``sample`` (samples, calibration) and ``span``
        (times, host_rows), unless a report kept already carries its workers' rows (None); a
        host's report drops its workers' own. The caller adds what else it keeps of the
        report, ``(list, entry)``, to the list returned, dropped with it."""
        self.msgs[id(msg)] = msg
        if all(self.rows.get(i, 0) is None for i in ids) or (own and ids[0] in self.rows):
            return None
        for where, entry in [e for i in ids if not own for e in self.rows.get(i) or ()]:
            where[:] = [e for e in where if e is not entry]
        added = [(self.samples, sample), (self.spans, span)]
        for where, entry in added:
            where.append(entry)
        self.rows.update({ids[0]: added} if own else dict.fromkeys(ids, None))
        return added


def named(times: np.ndarray, servers: int) -> np.ndarray:
    """Which of a report's server times ``(rank, bytes, seconds)`` name a server (mask)."""
    rank, secs = times[:, 0], times[:, 2]
    with np.errstate(invalid="ignore"):
        return (rank >= 0) & (rank < servers) & (rank == np.floor(rank)) & (secs > 0)


def longest_named(times: np.ndarray, servers: int) -> np.ndarray:
    """A worker's server times ``(rank, bytes, seconds)`` as :func:`spans` reads them: its
    longest that names a server, one row or none (what a host's leader sends unless the plan
    fits a line per server: cluster/hostlead.py)."""
    secs = np.where(named(times, servers), times[:, 2], -1.0)
    if not len(secs) or secs.max() <= 0:
        return times[:0]
    k = int(np.argmax(secs))
    return times[k : k + 1]


def times_shrink(balance: str, servers: int) -> Callable[[np.ndarray], np.ndarray] | None:
    """What a host's leader keeps of each worker's server times under plan ``balance``: each
    worker's longest that names a server (:func:`longest_named`), unless the plan fits a line
    per server from all of them (None: keep all)."""
    if getattr(PLANS.get(balance), "needs", "history") == "history":
        return None
    return lambda times: longest_named(times, servers)


def spans(reports: Sequence[tuple[np.ndarray, Sequence | None]], servers: int) -> list[float]:
    """Each worker's last round, from a whole round's reports ``(times, host_rows)`` in one
    pass: the longest of its times that name a server (a host's report holds one run of
    rows per worker, by ``host_rows``), in report order."""
    times = np.concatenate([t for t, _ in reports] or [np.zeros((0, 3))])
    counts = np.asarray([r[1] for t, rows in reports for r in rows or [(0, len(t))]], np.int64)
    starts = (np.cumsum(counts) - counts)[counts > 0]
    if not len(starts):
        return []
    longest = np.maximum.reduceat(np.where(named(times, servers), times[:, 2], -1.0), starts)
    return longest[longest > 0].tolist()


def listed(values: np.ndarray) -> list[float | None]:
    """A JSON-ready list: NaN (unknown) becomes None."""
    return [float(x) if np.isfinite(x) else None for x in values]
