"""Algorithm 2 (``assign``) with heaps against the implementation it replaced, kept here as the
reference: the same assignment on many random layouts and shares (ties, idle servers,
previous assignments, integer and float shares)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from numpy.typing import ArrayLike

from hetps.balance.slicing import Slice, assign, layout

# ---------------------------------------------------------------- the reference (old code)


def reference_assign(
    slices: Sequence[Slice],
    shares: ArrayLike,
    *,
    previous: Sequence[int] | None = None,
    probe_num: int = 0,
) -> np.ndarray:
    """Server index (into ``shares``) for every slice: the paper's Algorithm 2.

    ``shares`` are target amounts per server, in any unit: they are scaled to the slices'
    total length. Steps:

    1. every server with a zero share (an *idle* server) first gets ``probe_num`` probe
       slices (the shortest ones, its previous slices first) so its links stay measured;
    2. with ``previous`` (last iteration's assignment), a slice stays where it was while that
       server still has room for it, longest slices first -- fewer slices move, and a moving
       slice must carry its weights and optimizer state. (In layout order, small slices that
       stayed could fill a server's room and strand a long one, which step 3 then had to put
       where it overshot: on the 8-node benchmark that kept a plan ~7% from the optimum,
       below the planner's 10% margin, so the better plan was never adopted);
    3. the other full-length slices, in layout order, each go to the server whose own step-3
       slices are least far along once it takes this one (smallest ``(placed + length) /
       need``; ties: lower index), among those with room for it. Workers push in layout
       order, all at once, so this spreads every server's slices evenly through the push
       order (largest-remaining-share order gave the biggest server a run of its first
       slices, the smallest ones theirs at the end);
    4. the shorter slices (key tails) and full ones that fit nowhere whole, longest first, to
       the server with the largest remaining share: they fill the fragments, so the shares
       come out as exact as before.

    With equal slice lengths, integer slice-count shares and ``probe_num == 0`` every server
    gets exactly its count.
    """
    sh = np.asarray(shares)
    if sh.ndim != 1 or sh.size == 0:
        raise ValueError("shares must be a non-empty 1-d array")
    if not np.isfinite(sh.astype(float)).all() or (sh < 0).any():
        raise ValueError("shares must be finite and >= 0")
    n_sl = len(slices)
    n_s = sh.size
    lengths = [int(s.length) for s in slices]
    if any(v < 0 for v in lengths):
        raise ValueError("slice lengths must be >= 0")
    if probe_num < 0:
        raise ValueError(f"probe_num must be >= 0, got {probe_num}")
    if previous is not None and len(previous) != n_sl:
        raise ValueError(f"previous has {len(previous)} entries for {n_sl} slices")
    total_len = sum(lengths)
    out = np.full(n_sl, -1, dtype=np.int64)
    if n_sl == 0:
        return out
    if sh.sum() <= 0:
        raise ValueError("shares must have a positive sum")
    # remaining share of server s, scaled by sum(shares): exact integers when shares are ints
    if np.issubdtype(sh.dtype, np.integer):
        ssum = int(sh.sum())
        rem: list[float | int] = [int(v) * total_len for v in sh]
    else:
        ssum = 1
        shf = sh.astype(float)
        rem = list(shf / shf.sum() * total_len)

    def give(i: int, s: int) -> None:
        out[i] = s
        rem[s] -= lengths[i] * ssum

    prev = None if previous is None else [int(p) for p in previous]
    if probe_num:
        by_len = sorted(range(n_sl), key=lambda i: (lengths[i], i))
        for s in range(n_s):
            if sh[s] != 0:
                continue
            mine = [i for i in by_len if out[i] < 0 and prev is not None and prev[i] == s]
            rest = [i for i in by_len if out[i] < 0 and (prev is None or prev[i] != s)]
            for i in (mine + rest)[:probe_num]:
                give(i, s)
    if prev is not None:
        for i in sorted(range(n_sl), key=lambda i: (-lengths[i], i)):
            s = prev[i]
            if out[i] < 0 and 0 <= s < n_s and sh[s] > 0 and rem[s] >= lengths[i] * ssum:
                give(i, s)
    # step 3, in layout order: each full-length slice to the server whose own slices are
    # least far along (smallest (placed + length) / need), among those with room for it, so
    # that every server's slices are spread evenly through the layout
    need = [max(r, 0) for r in rem]
    placed = [0] * n_s
    left = []
    full = max(lengths[i] for i in range(n_sl) if out[i] < 0) if (out < 0).any() else 0
    for i in range(n_sl):
        if out[i] >= 0:
            continue
        if lengths[i] < full:
            left.append(i)
            continue
        cost = lengths[i] * ssum
        room = [s for s in range(n_s) if need[s] > 0 and rem[s] >= cost]
        if not room:
            left.append(i)
            continue
        s = min(room, key=lambda s: ((placed[s] + cost) / need[s], s))
        placed[s] += cost
        give(i, s)
    # shorter slices and what fits nowhere whole: longest first, to the server with the
    # most room left (they fill what the full slices left, so the shares come out exact)
    for i in sorted(left, key=lambda i: (-lengths[i], i)):
        best = max(range(n_s), key=lambda s: (rem[s], -s))
        give(i, best)
    return out


# ---------------------------------------------------------------- random cases


def _case(rng: np.random.Generator):
    n_s = int(rng.integers(1, 40))
    sizes = [int(x) for x in rng.integers(0, 2000, size=int(rng.integers(1, 12)))]
    if sum(sizes) == 0:
        sizes[0] = 1
    slices = layout(sizes, int(rng.choice([1, 7, 64, 100, 256])))
    kind = rng.random()
    if kind < 0.3:  # whole slice counts, ties everywhere
        shares = rng.integers(0, 4, size=n_s)
        if shares.sum() == 0:
            shares[0] = 1
    elif kind < 0.6:  # few distinct values: ties
        shares = rng.choice([0.0, 0.5, 1.0, 1.0, 2.0], size=n_s)
        if shares.sum() == 0:
            shares[-1] = 1.0
    else:
        shares = rng.uniform(0, 1, size=n_s) * (rng.random(n_s) < 0.9)
        if shares.sum() == 0:
            shares[0] = 0.3
    prev = None
    if rng.random() < 0.7:
        prev = [int(x) for x in rng.integers(0, n_s, size=len(slices))]
    probe = int(rng.choice([0, 0, 1, 2]))
    return slices, shares, prev, probe


@pytest.mark.parametrize("seed", range(40))
def test_heap_assign_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(10):
        slices, shares, prev, probe = _case(rng)
        want = reference_assign(slices, shares, previous=prev, probe_num=probe)
        got = assign(slices, shares, previous=prev, probe_num=probe)
        assert got.tolist() == want.tolist()


def test_heap_assign_equals_the_reference_at_planner_scale():
    rng = np.random.default_rng(3)
    for s in (64, 256):
        slices = layout([4 * s * 65536 + 1000, 5000], 65536)
        shares = rng.uniform(0.2, 1.0, size=s)
        prev = [i % s for i in range(len(slices))]
        for p in (None, prev):
            want = reference_assign(slices, shares, previous=p, probe_num=1)
            assert assign(slices, shares, previous=p, probe_num=1).tolist() == want.tolist()
