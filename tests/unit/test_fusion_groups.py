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


def _paused_model(pause_s: float):
    import time

    import torch

    class Pause(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(pause_s)  # an expensive layer's backward (emulated compute)
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 20_000)

        def forward(self, x):
            return self.head(Pause.apply(self.stem(x)))

    return Net()


@pytest.mark.parametrize(("pause_s", "head_inline"), [(0.02, False), (0.0, True)])
def test_hooks_send_the_groups_near_backward_end_themselves(pause_s, head_inline, monkeypatch):
    """After the timed steps a group ready well before backward ends goes to the launcher
    thread; one ready near the end is sent by its hook (no wake-up to wait for)."""
    import torch

    import hetps.torch.regroup as mod
    from hetps.kvstore.local import LocalKVStore
    from hetps.torch.optimizer import DistributedOptimizer

    monkeypatch.setattr(mod, "LAUNCH_INLINE_S", 0.005)  # far from both cases on a busy machine

    model = _paused_model(pause_s)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        kvstore=LocalKVStore(),
        fusion_bytes=1 << 10,
    )
    try:
        # a launcher thread; a local store: no re-making
        assert opt._launches._thread is not None and opt.tune_steps == 0
        head = opt._group_of["head.weight"]
        assert not head.inline and opt._group_of["stem.weight"].inline
        for _ in range(5):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        assert head.inline is head_inline
        assert opt._group_of["stem.weight"].inline  # the last group: always its hook
    finally:
        opt.close()
