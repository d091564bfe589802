"""plan_groups: tensor fusion by size, and the cuts where backward pauses."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hetps.torch.optimizer import plan_groups  # noqa: E402

K = "f32"


def test_sizes_alone_fill_groups_and_big_ones_go_alone():
    entries = [("a", 100, K, None), ("b", 200, K, None), ("c", 1000, K, None), ("d", 50, K, None)]
    assert plan_groups(entries, 400) == [["a", "b"], ["c"], ["d"]]
    assert plan_groups(entries, 0) == [["a"], ["b"], ["c"], ["d"]]


def test_kinds_do_not_mix():
    entries = [("a", 10, "f32", None), ("b", 10, "f64", None), ("c", 10, "f64", None)]
    assert plan_groups(entries, 1000) == [["a"], ["b", "c"]]


def test_a_pause_closes_a_group_that_holds_enough():
    # a (70 KB) ready at 0, b at 0.1 ms, then backward works 1 ms before c and d
    entries = [
        ("a", 70_000, K, 0.0),
        ("b", 500, K, 0.0001),
        ("c", 600, K, 0.0011),
        ("d", 600, K, 0.0012),
    ]
    assert plan_groups(entries, 256 << 10) == [["a", "b"], ["c", "d"]]
    # a pause shorter than the gap, or a group too small to gain from leaving early: no cut
    assert plan_groups(entries, 256 << 10, gap_s=0.002) == [["a", "b", "c", "d"]]
    assert plan_groups(entries, 256 << 10, split_bytes=80_000) == [["a", "b", "c", "d"]]


def test_the_size_bound_still_holds_with_times():
    entries = [("a", 150, K, 0.0), ("b", 150, K, 0.0), ("c", 150, K, 0.0)]
    assert plan_groups(entries, 300, gap_s=1.0, split_bytes=1) == [["a", "b"], ["c"]]
