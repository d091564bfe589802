"""A round's reports read in batches as they come (balance/reports.py, RoundSamples): the same
rows, in the same order, as reading them all at once when the round is whole."""

from __future__ import annotations

import numpy as np

from hetps.balance.hosts import row_lookup
from hetps.balance.reports import READ_BATCH, RoundSamples, read_samples, round_data
from hetps.cluster import protocol as P

S, W = 4, 2 * READ_BATCH + 7  # two batches and some left over


def _reports(rng: np.random.Generator) -> tuple[list[np.ndarray], list[bool]]:
    reports, calibration = [], []
    for w in range(W):
        n = int(rng.integers(0, 12))
        a = np.zeros((n, 6))
        a[:, 0] = P.worker_id(w)
        a[:, 1] = [P.server_id(int(s)) for s in rng.integers(0, S, n)]
        a[:, 2] = rng.integers(0, 4, n) * 1e6  # (some moved no bytes)
        a[:, 3] = rng.uniform(0, 1, n)
        a[:, 4] = a[:, 3] + rng.uniform(-0.1, 1, n)  # (some took no time)
        a[:, 5] = rng.choice([0, 0, 0, 1, 2, 3], n)  # data, a probe, spread flows
        if n:
            a[0, 1] = 1e9 if w % 5 == 0 else a[0, 1]  # (names no node)
            a[-1, 4] = np.nan if w % 7 == 0 else a[-1, 4]
        reports.append(a)
        calibration.append(w % 11 == 3)
    return reports, calibration


def test_a_round_read_in_batches_is_the_round_read_at_once():
    rng = np.random.default_rng(0)
    ids = [P.server_id(s) for s in range(S)] + [P.worker_id(w) for w in range(W)]
    lookup = row_lookup(ids, [*range(S), *(S + w // 4 for w in range(W))])  # (hosts of 4)
    reports, calibration = _reports(rng)
    got = RoundSamples()
    for a, c in zip(reports, calibration, strict=True):
        got.add(lookup, a, c)
    assert len(got.read) == 2  # (read as they came: two batches, the rest at the end)
    parts = got.parts(lookup)
    whole = read_samples(lookup, reports, calibration)
    for x, y in zip(round_data(parts), whole.data, strict=True):
        np.testing.assert_array_equal(x, y)
    few = [np.concatenate([getattr(p, k) for p in parts]) for k in ("src", "dst", "few")]
    for x, y in zip(few, (whole.src, whole.dst, whole.few), strict=True):
        np.testing.assert_array_equal(x, y)
    flags = np.concatenate([p.few_calibration for p in parts])
    np.testing.assert_array_equal(flags, whole.few_calibration)
    assert len(whole.data[0]) and len(whole.few) and whole.few_calibration.any()
    # the rows changed since a batch was read (the hosts became known): read again
    flat = row_lookup(ids, range(len(ids)))
    again = round_data(got.parts(flat))
    for x, y in zip(again, read_samples(flat, reports, calibration).data, strict=True):
        np.testing.assert_array_equal(x, y)
