"""benchmarks/round_model.py: the fluid model of a synchronous round, checked where the
answer can be worked out by hand, and against the lower bound it must never beat."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "round_model.py"
_spec = importlib.util.spec_from_file_location("round_model", _PATH)
rm = importlib.util.module_from_spec(_spec)
sys.modules["round_model"] = rm  # (dataclasses look their module up there)
_spec.loader.exec_module(rm)

MB = 1e6


@pytest.mark.parametrize("barrier", [False, True])
def test_two_equal_nodes_take_exactly_the_bound(barrier):
    """Two nodes at c bytes/s, slices of b bytes alternating between their servers, no
    window. Node 0's uplink carries worker 0's pushes of the odd slices and server 0's
    replies of the even ones. The first push has the link alone (b/c); then pushes and
    replies share it, the replies keeping up with the other worker's pushes as they
    arrive, until the last reply goes alone: (S - 1) b / c + b / c = M / c, the bound."""
    c, b, S = 10 * MB, 50_000, 40
    case = rm.Case([c, c], [b] * S, [s % 2 for s in range(S)])
    assert case.lower_bound() == pytest.approx(S * b / c)
    per = rm.simulate(case, rounds=3, window=0, policy="fair", dt=1e-4, barrier=barrier)
    assert per == pytest.approx([S * b / c] * 2, rel=0.01)


def _random_case(rng, n=4, slices=48):
    from hetps.balance import Network, make_plan
    from hetps.balance.slicing import Slice, assign

    rates = list(rng.uniform(2, 12, n) * MB)
    sizes = [40_000] * slices
    shares = make_plan(
        "optimal",
        float(slices),
        network=Network.from_rates(rates, rates),
        servers=range(n),
        workers=range(n),
    )
    owner = assign([Slice(0, k, 1) for k in range(slices)], shares)
    return rm.Case(rates, sizes, [int(o) for o in owner])


def test_one_band_is_fair_sharing_and_a_barrier_never_beats_the_bound():
    """The bands policy with one class is max-min fair sharing, to the last float; with a
    barrier between rounds no policy moves bytes faster than the links either."""
    case = _random_case(np.random.default_rng(3))
    fair = rm.simulate(case, rounds=3, window=256 << 10, policy="fair", dt=2e-4)
    one = rm.simulate(case, rounds=3, window=256 << 10, policy="bands", bands=1, dt=2e-4)
    assert one == fair
    for policy in ("fair", "bands"):
        per = rm.simulate(case, rounds=2, window=256 << 10, policy=policy, dt=2e-4, barrier=True)
        assert case.lower_bound() * 0.995 <= per[0] < case.lower_bound() * 3


def test_a_band_per_slice_behind_a_barrier_is_earliest_slice_first():
    """Equal slices, as many bands as slices: each slice has a class of its own, in layout
    order. Behind a barrier only one round is on the links, so that is exactly
    slice-order. Without the barrier the next round's first slices share the first class
    with the last round's, and the rounds come out differently."""
    case = _random_case(np.random.default_rng(5), slices=32)
    kw = {"rounds": 3, "window": 256 << 10, "dt": 2e-4}
    order = rm.simulate(case, policy="slice-order", barrier=True, **kw)
    banded = rm.simulate(case, policy="bands", bands=32, barrier=True, **kw)
    assert banded == order
    assert rm.simulate(case, policy="bands", bands=32, **kw) != banded


@pytest.mark.parametrize("policy", rm.POLICIES)
def test_no_policy_beats_the_bound(policy):
    """Random heterogeneous networks and placements: every policy's round takes at least
    the fluid bound (a model moving bytes faster than its links would pass for a
    schedule)."""
    from hetps.balance import Network, make_plan
    from hetps.balance.slicing import Slice, assign

    rng = np.random.default_rng(7)
    for _ in range(2):
        n = 4
        rates = list(rng.uniform(2, 12, n) * MB)
        sizes = [40_000] * 48
        slices = [Slice(0, k, 1) for k in range(len(sizes))]
        shares = make_plan(
            "optimal",
            float(len(sizes)),
            network=Network.from_rates(rates, rates),
            servers=range(n),
            workers=range(n),
        )
        case = rm.Case(rates, sizes, [int(o) for o in assign(slices, shares)])
        bound = case.lower_bound()
        per = rm.simulate(case, rounds=2, window=256 << 10, policy=policy, dt=2e-4)
        assert bound * 0.995 <= per[0] < bound * 3


def test_bad_input_is_named():
    case = rm.Case([1e6, 1e6], [1000, 1000], [0, 2])
    with pytest.raises(ValueError, match="owner must name a server"):
        rm.simulate(case)
    with pytest.raises(ValueError, match="policy 'lifo' is not one of fair"):
        rm.simulate(rm.Case([1e6, 1e6], [1000], [0]), policy="lifo")
    with pytest.raises(ValueError, match="bands must be at least 1"):
        rm.simulate(rm.Case([1e6, 1e6], [1000], [0]), policy="bands", bands=0)
