"""ESync's readiness policy (exact who-is-ready-when scenarios) and the update rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetps.esync.policy import ReadinessPolicy
from hetps.sync import (
    average,
    average_from_sum,
    dcasgd_compensate,
    dcasgd_step,
    esync_global_update,
    esync_update_from_sum,
    model_delta,
    sgd_step,
    ssgd_step,
    sum_arrays,
)

# ---------------------------------------------------------------------------------------------
# Helpers: drive the policy like workers that start a new step as soon as one ends.


def warm(policy: ReadinessPolicy, times: list[float], t0: float = -100.0) -> None:
    """Run a lockstep first round so that every worker has an estimate."""
    policy.start_round(t0)
    for w, c in enumerate(times):
        assert policy.report_step(w, c, t0 + c) is True
    assert policy.round_complete()


def simulate(policy: ReadinessPolicy, start: float, step_time) -> dict[int, tuple[int, float]]:
    """Simulate one round; ``step_time(worker, k)`` is the duration of worker's k-th step.

    Workers start a new step as soon as the previous one ends and report its true duration;
    events are processed in time order (ties by worker id). Returns {worker: (steps, t_ready)}.
    """
    policy.start_round(start)
    clock = {w: float(start) for w in range(policy.num_workers)}
    done: dict[int, tuple[int, float]] = {}
    while len(done) < policy.num_workers:
        pending = {}
        for w in clock:
            if w not in done:
                dur = step_time(w, policy.local_steps(w))
                pending[w] = (clock[w] + dur, dur)
        w = min(pending, key=lambda v: (pending[v][0], v))
        end, dur = pending[w]
        clock[w] = end
        if policy.report_step(w, dur, end):
            done[w] = (policy.local_steps(w), end)
    assert policy.round_complete()
    return done


def const(times: list[float]):
    return lambda w, k: times[w]


# ---------------------------------------------------------------------------------------------
# ReadinessPolicy: exact scenarios


def test_first_round_is_lockstep_everyone_one_step():
    p = ReadinessPolicy(3)
    p.start_round(0.0)
    assert p.slowest() is None and p.deadline() is None
    assert p.report_step(0, 1.0, 1.0) is True
    assert not p.round_complete()
    assert p.report_step(1, 2.0, 2.0) is True
    assert p.report_step(2, 4.0, 4.0) is True
    assert p.round_complete()
    assert [p.local_steps(w) for w in range(3)] == [1, 1, 1]
    assert [p.estimate(w) for w in range(3)] == [1.0, 2.0, 4.0]


def test_times_1_2_4_everyone_finishes_with_the_slowest():
    # Deadline 4: a step that would end exactly at 4 is still taken (no one waits for it).
    p = ReadinessPolicy(3)
    warm(p, [1.0, 2.0, 4.0])
    assert simulate(p, 0.0, const([1.0, 2.0, 4.0])) == {0: (4, 4.0), 1: (2, 4.0), 2: (1, 4.0)}
    assert p.slowest() == 2


def test_times_1_2_4_step_by_step_answers():
    p = ReadinessPolicy(3)
    warm(p, [1.0, 2.0, 4.0])
    assert p.start_round(0.0) == 2
    assert p.slowest() == 2 and p.deadline() == 4.0
    assert p.report_step(0, 1.0, 1.0) is False  # 1 + 1 <= 4
    assert p.report_step(0, 1.0, 2.0) is False
    assert p.report_step(1, 2.0, 2.0) is False  # 2 + 2 <= 4
    assert p.report_step(0, 1.0, 3.0) is False  # 3 + 1 == 4: still taken
    assert p.is_ready(0) is False
    assert p.report_step(0, 1.0, 4.0) is True  # 4 + 1 > 4
    assert p.report_step(1, 2.0, 4.0) is True
    assert not p.round_complete()
    assert p.report_step(2, 4.0, 4.0) is True  # the slowest: exactly one step
    assert p.round_complete()
    assert [p.local_steps(w) for w in range(3)] == [4, 2, 1]


def test_margin_stops_fast_workers_earlier():
    # ESync's epsilon: ready when now + c > deadline - margin.
    p = ReadinessPolicy(3, margin_s=0.5)
    warm(p, [1.0, 2.0, 4.0])
    assert simulate(p, 0.0, const([1.0, 2.0, 4.0])) == {0: (3, 3.0), 1: (1, 2.0), 2: (1, 4.0)}


def test_non_integer_times():
    p = ReadinessPolicy(3)
    warm(p, [0.3, 0.7, 1.0])
    # Deadline 10 + 1.0 = 11.0. The estimates follow the latest step: worker 0 now takes
    # 0.25-s steps, the 4th ends at 11.0 exactly; worker 1's 0.75-s step ends at 10.75 and
    # another would end at 11.5.
    got = simulate(p, 10.0, const([0.25, 0.75, 1.0]))
    assert got == {0: (4, 11.0), 1: (1, 10.75), 2: (1, 11.0)}


def test_slowest_is_chosen_from_estimates_and_changes_between_rounds():
    p = ReadinessPolicy(2)
    warm(p, [1.0, 3.0])
    assert simulate(p, 0.0, lambda w, k: [1.0, 5.0][w]) == {0: (3, 3.0), 1: (1, 5.0)}
    # Worker 1 was slower than expected: worker 0 stopped at the expected deadline 3.
    assert p.estimate(1) == 5.0
    # Now worker 0 becomes the slow one; worker 1 (estimate 5) is still this round's slowest
    # and finishes at 7, so worker 0 is ready after its single 6-s step.
    assert simulate(p, 5.0, lambda w, k: [6.0, 2.0][w]) == {0: (1, 11.0), 1: (1, 7.0)}
    assert p.slowest() == 1
    # Next round the roles swap: deadline 11 + 6 = 17; worker 1 steps end at 13, 15, 17.
    assert simulate(p, 11.0, lambda w, k: [6.0, 2.0][w]) == {0: (1, 17.0), 1: (3, 17.0)}
    assert p.slowest() == 0


def test_worker_becomes_slower_mid_round():
    # Worker 0's third step takes 2.5 s instead of 1 s: its estimate jumps and it stops.
    p = ReadinessPolicy(2)
    warm(p, [1.0, 6.0])
    got = simulate(p, 0.0, lambda w, k: (1.0 if k < 2 else 2.5) if w == 0 else 6.0)
    # steps end at 1, 2, 4.5; after 4.5: 4.5 + 2.5 = 7 > 6 -> ready.
    assert got == {0: (3, 4.5), 1: (1, 6.0)}


def test_fast_worker_slower_than_the_slowest_is_ready_after_that_step():
    p = ReadinessPolicy(3)
    warm(p, [1.0, 1.0, 4.0])
    got = simulate(p, 0.0, lambda w, k: 10.0 if (w == 0 and k == 1) else [1.0, 1.0, 4.0][w])
    assert got == {0: (2, 11.0), 1: (4, 4.0), 2: (1, 4.0)}


def test_slowest_finishing_early_makes_later_reporters_ready():
    p = ReadinessPolicy(2)
    warm(p, [1.0, 4.0])
    p.start_round(0.0)
    assert p.report_step(0, 1.0, 1.0) is False
    assert p.report_step(1, 1.5, 1.5) is True  # the slowest finished early
    assert p.deadline() == 1.5
    assert p.report_step(0, 1.0, 2.0) is True  # 2 + 1 <= 4 but the slowest is done
    assert [p.local_steps(w) for w in range(2)] == [2, 1]


def test_everyone_takes_at_least_one_step():
    p = ReadinessPolicy(2)
    warm(p, [5.0, 4.0])  # worker 0 is the slowest
    p.start_round(0.0)
    # worker 1 started very late: even its first step would overshoot, still it takes one.
    assert p.is_ready(1, now=3.0) is False
    assert p.report_step(1, 4.0, 7.0) is True
    assert p.local_steps(1) == 1


def test_is_ready_query_before_a_step_and_stickiness():
    p = ReadinessPolicy(2)
    warm(p, [1.0, 4.0])
    p.start_round(0.0)
    assert p.report_step(0, 1.0, 1.0) is False
    assert p.is_ready(0, now=2.0) is False  # 2 + 1 <= 4
    assert p.is_ready(0, now=3.5) is True  # idled until 3.5: 3.5 + 1 > 4
    assert p.is_ready(0) is True  # recorded
    with pytest.raises(ValueError, match="already ready"):
        p.report_step(0, 1.0, 4.5)


def test_mark_start_refines_the_slowest_start():
    p = ReadinessPolicy(2)
    warm(p, [1.0, 4.0])
    p.start_round(0.0)
    p.mark_start(1, 0.5)  # the slowest pulled the global model late
    assert p.deadline() == 4.5
    assert p.report_step(0, 1.0, 3.5) is False  # 3.5 + 1 == 4.5: still taken
    assert p.report_step(0, 1.0, 4.5) is True
    assert p.report_step(1, 4.0, 4.5) is True
    with pytest.raises(ValueError, match="already reported"):
        p.mark_start(0, 1.0)


def test_new_round_resets_counts():
    p = ReadinessPolicy(2)
    warm(p, [1.0, 2.0])
    simulate(p, 0.0, const([1.0, 2.0]))
    assert p.round == 2
    p.start_round(2.0)
    assert p.round == 3
    assert [p.local_steps(w) for w in range(2)] == [0, 0]
    assert not p.round_complete() and not p.is_ready(0)
    states = p.state()
    assert [s.steps for s in states] == [0, 0] and states[1].estimate_s == 2.0


def test_single_worker_and_equal_times():
    p = ReadinessPolicy(1)
    warm(p, [2.0])
    assert simulate(p, 0.0, const([2.0])) == {0: (1, 2.0)}
    q = ReadinessPolicy(3)
    warm(q, [2.0, 2.0, 2.0])
    assert simulate(q, 0.0, const([2.0, 2.0, 2.0])) == {0: (1, 2.0), 1: (1, 2.0), 2: (1, 2.0)}
    assert q.slowest() == 0  # lowest id on a tie


def test_smoothing_blends_estimates():
    p = ReadinessPolicy(1, smoothing=0.5)
    p.start_round(0.0)
    p.report_step(0, 2.0, 2.0)
    p.start_round(2.0)
    p.report_step(0, 4.0, 6.0)
    assert p.estimate(0) == 3.0


def test_errors():
    with pytest.raises(ValueError):
        ReadinessPolicy(0)
    with pytest.raises(ValueError):
        ReadinessPolicy(2, margin_s=-1.0)
    with pytest.raises(ValueError):
        ReadinessPolicy(2, smoothing=1.0)
    p = ReadinessPolicy(2)
    with pytest.raises(RuntimeError, match="start_round"):
        p.report_step(0, 1.0, 1.0)
    p.start_round(0.0)
    with pytest.raises(ValueError, match="worker"):
        p.report_step(2, 1.0, 1.0)
    with pytest.raises(ValueError, match="step_time_s"):
        p.report_step(0, -1.0, 1.0)
    with pytest.raises(ValueError, match="now"):
        p.report_step(0, 1.0, float("nan"))


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(
        st.integers(min_value=1, max_value=40).map(lambda v: v / 8), min_size=1, max_size=6
    ),
    margin=st.sampled_from([0.0, 0.25, 1.0]),
)
def test_properties_with_constant_step_times(times, margin):
    """Slowest takes one step; others take the most steps that end by the deadline - margin."""
    p = ReadinessPolicy(len(times), margin_s=margin)
    warm(p, times)
    got = simulate(p, 0.0, const(times))
    slow = p.slowest()
    deadline = times[slow]
    assert got[slow] == (1, deadline)
    for w, (steps, t_ready) in got.items():
        assert t_ready == pytest.approx(steps * times[w])
        if w == slow:
            continue
        expect = max(1, int((deadline - margin) // times[w]))
        assert steps == expect
        # nobody keeps the slowest waiting beyond one of its own steps past the deadline
        assert t_ready <= max(deadline, times[w]) + 1e-9


# ---------------------------------------------------------------------------------------------
# Update rules: exact vectors (dyadic fractions, so float results are exact)


def test_average_and_sum_exact():
    g = [np.array([1.0, 2.0, -4.0]), np.array([3.0, 0.5, 0.0]), np.array([2.0, 0.5, 1.0])]
    np.testing.assert_array_equal(sum_arrays(g), [6.0, 3.0, -3.0])
    np.testing.assert_array_equal(average(g), [2.0, 1.0, -1.0])
    assert average([np.ones(2, np.float32)]).dtype == np.float32
    assert average([np.array([1, 2]), np.array([2, 3])]).dtype == np.float64
    x = np.array([1.0, 2.0])
    average([x, x])
    np.testing.assert_array_equal(x, [1.0, 2.0])  # inputs untouched


def test_ssgd_and_sgd_exact():
    w = np.array([1.0, -2.0, 0.5])
    grads = [np.array([0.5, 1.0, 0.0]), np.array([1.5, -1.0, 2.0])]
    np.testing.assert_array_equal(ssgd_step(w, grads, lr=0.5), [0.5, -2.0, 0.0])
    np.testing.assert_array_equal(
        sgd_step(w, np.array([1.0, 1.0, 1.0]), lr=0.5, wd=0.5), [0.25, -2.0, -0.125]
    )


def test_esync_global_update_exact():
    w_round = np.array([1.0, 2.0, 3.0, 4.0])
    w_workers = [np.array([2.0, 2.0, 3.0, 0.0]), np.array([1.0, 4.0, 2.0, 4.0])]
    deltas = [model_delta(w, w_round) for w in w_workers]
    np.testing.assert_array_equal(deltas[0], [1.0, 0.0, 0.0, -4.0])
    np.testing.assert_array_equal(deltas[1], [0.0, 2.0, -1.0, 0.0])
    # global_lr = 1: plain model average
    np.testing.assert_array_equal(esync_global_update(w_round, deltas), [1.5, 3.0, 2.5, 2.0])
    np.testing.assert_array_equal(average(w_workers), [1.5, 3.0, 2.5, 2.0])
    # global_lr = 0.5
    np.testing.assert_array_equal(
        esync_global_update(w_round, deltas, global_lr=0.5), [1.25, 2.5, 2.75, 3.0]
    )
    np.testing.assert_array_equal(
        esync_update_from_sum(w_round, sum_arrays(deltas), 2, global_lr=0.5),
        [1.25, 2.5, 2.75, 3.0],
    )


def test_dcasgd_compensate_exact():
    g = np.array([1.0, 2.0, -2.0, 0.0])
    w = np.array([1.0, 1.0, 1.0, 5.0])
    b = np.array([0.0, 1.5, 2.0, 1.0])
    # g + 0.5 * g^2 * (w - b) = [1 + 0.5*1*1, 2 + 0.5*4*(-0.5), -2 + 0.5*4*(-1), 0]
    np.testing.assert_array_equal(dcasgd_compensate(g, w, b, lamda=0.5), [1.5, 1.0, -4.0, 0.0])
    np.testing.assert_array_equal(dcasgd_compensate(g, w, w, lamda=0.5), g)  # no delay


def test_dcasgd_step_by_hand():
    w = np.array([1.0, 1.0])
    g = np.array([1.0, 2.0])
    b = np.array([0.0, 1.5])
    new_w, new_b, mom = dcasgd_step(w, g, b, lr=0.5, lamda=0.5)
    # step = -0.5 * [1.5, 1.0]; the pusher's new backup is the weight it gets back
    np.testing.assert_array_equal(new_w, [0.25, 0.5])
    np.testing.assert_array_equal(new_b, new_w)
    assert mom is None and not np.shares_memory(new_b, new_w)
    # with momentum 0.5 and previous mom [1, -1]: mom = [0.5, -0.5] + [-0.75, -0.5]
    new_w, _, mom = dcasgd_step(w, g, b, lr=0.5, lamda=0.5, momentum=0.5, mom=[1.0, -1.0])
    np.testing.assert_array_equal(mom, [-0.25, -1.0])
    np.testing.assert_array_equal(new_w, [0.75, 0.0])
    # weight decay: step = -0.5 * (g + 0.5 * w + comp) with lamda 0
    new_w, _, _ = dcasgd_step(w, g, b, lr=0.5, lamda=0.0, wd=0.5)
    np.testing.assert_array_equal(new_w, [0.25, -0.25])
    # a worker that never pulled has no backup: no compensation
    new_w, _, _ = dcasgd_step(w, g, None, lr=0.5, lamda=0.5)
    np.testing.assert_array_equal(new_w, [0.5, 0.0])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_dcasgd_rule_is_what_the_servers_optimizer_applies(momentum, dtype):
    """The servers' DCASGD and the rule give the same bits over a run of pushes and pulls by
    three workers (one definition: per-worker backups, products in one order)."""
    from hetps.optim import DCASGD

    rng = np.random.default_rng(7)
    opt = DCASGD(learning_rate=0.05, lamda=2.0, momentum=momentum, wd=1e-3)
    weight = rng.standard_normal(101).astype(dtype)
    state = opt.create_state("k", weight)
    ref_w = weight.astype(np.float32)  # the rule computes float16 weights in float32
    ref_mom = None
    backups: dict[int, np.ndarray] = {}
    for i in range(30):
        sender = i % 3
        if i % 4 == 3:  # a pull: the puller's backup is the weight it receives
            opt.on_pull("k", weight, state, sender)
            backups[sender] = weight.astype(np.float32)
            continue
        grad = (3 * rng.standard_normal(101)).astype(dtype)
        opt.apply_update("k", weight, grad, state, sender)
        ref_w, _, ref_mom = dcasgd_step(
            ref_w, grad, backups.get(sender), 0.05, 2.0, 1e-3, momentum, ref_mom
        )
        ref_w = ref_w.astype(dtype).astype(np.float32)  # stored as the weight's dtype
        backups[sender] = ref_w
        assert weight.astype(np.float32).tobytes() == ref_w.tobytes(), i
        if momentum:
            assert state["mom"].tobytes() == ref_mom.tobytes(), i


def test_esync_and_average_rules_take_torch_tensors_with_the_same_bits():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    r, w = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    s = (rng.standard_normal(1000) * 3).astype(np.float32)
    tr, tw, ts = (torch.from_numpy(a.copy()) for a in (r, w, s))
    d = model_delta(tw, tr)
    assert isinstance(d, torch.Tensor) and d.numpy().tobytes() == model_delta(w, r).tobytes()
    got = esync_update_from_sum(tr, ts, 3, global_lr=0.7)
    assert got.numpy().tobytes() == esync_update_from_sum(r, s, 3, global_lr=0.7).tobytes()
    # evaluated left to right: (global_lr * sum) / K, not global_lr * (sum / K)
    assert got.numpy().tobytes() == (tr + 0.7 * ts / 3).numpy().tobytes()
    assert got.numpy().tobytes() != (r + np.float32(0.7) * (s / 3)).tobytes()
    mean = average_from_sum(ts, 3)
    assert mean.numpy().tobytes() == average_from_sum(s, 3).tobytes()
    buf = ts.clone()
    assert average_from_sum(buf, 3, out=buf) is buf
    assert buf.numpy().tobytes() == mean.numpy().tobytes()
    with pytest.raises(TypeError, match="mix"):
        model_delta(tw, r)


def test_rules_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        average([np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match="at least one"):
        average([])
    with pytest.raises(ValueError, match="shape"):
        dcasgd_compensate(np.zeros(2), np.zeros(2), np.zeros(3), 0.1)
    with pytest.raises(ValueError, match="num_workers"):
        esync_update_from_sum(np.zeros(2), np.zeros(2), 0)


def test_numpy_integer_worker_ids():
    p = ReadinessPolicy(2)
    p.start_round(0.0)
    assert p.report_step(np.int64(1), 1.0, 1.0) is True
    assert p.local_steps(np.int32(1)) == 1
    with pytest.raises(ValueError, match="worker"):
        p.local_steps(True)


def test_state_service_tells_a_fast_worker_its_deadline():
    """The answer carries the time left until the slowest's expected end, so the worker can
    take its later local steps without a round trip each."""
    from hetps.esync.service import EsyncService

    svc = EsyncService(2, margin_s=0.5)
    # round 1 is lockstep (no estimates yet): one step each, worker 0 takes 1 s, worker 1 4 s
    assert svc.decide(0, 1, 1.0, 1.0, 101.0)["ready"]
    assert svc.decide(1, 1, 4.0, 4.0, 104.0)["ready"]
    # round 2 starts at t=110 for both: worker 1 (4 s) is the slowest, deadline t=114
    ans = svc.decide(0, 2, 1.0, 1.0, 111.0)
    assert ans["ready"] is False and ans["steps"] == 1
    assert ans["deadline_in_s"] == pytest.approx(114.0 - 0.5 - 111.0)
    # the slowest is ready after its one step; its answer has no deadline to pass on
    ans = svc.decide(1, 2, 4.0, 4.0, 114.0)
    assert ans["ready"] is True and "deadline_in_s" not in ans
    # a report that arrives after the slowest finished is ready at once
    assert svc.decide(0, 2, 1.0, 2.0, 114.2)["ready"] is True


def test_a_report_of_round_0_is_refused_and_the_service_goes_on():
    """Round 0 is before any round: a report of it is refused (it crashed the service)."""
    from hetps.esync.service import EsyncService

    svc = EsyncService(2)
    with pytest.raises(ValueError, match="rounds start at 1"):
        svc.decide(0, 0, 1.0, 1.0, 100.0)
    assert svc.decide(0, 1, 1.0, 1.0, 101.0)["ready"]
