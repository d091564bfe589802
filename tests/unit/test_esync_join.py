"""A worker that joins a running ESync job again (HETPS_ELASTIC), piece by piece: the
readiness policy counts it again (``ReadinessPolicy.add``), the state service hears of it
from the scheduler's hook before the live workers go on, and the trainer of a joiner makes no
broadcast and takes the live workers' round. The processes, the kill and the join are in
tests/e2e/test_checkpoint.py (test_a_dead_esync_worker_started_again_joins_the_running_job)."""

from __future__ import annotations

import pytest
import torch

from hetps.cluster import protocol as P
from hetps.cluster.protocol import NodeInfo
from hetps.esync.policy import ReadinessPolicy
from hetps.esync.service import EsyncService
from hetps.esync.trainer import ESyncTrainer
from hetps.roles import new_scheduler
from hetps.transport.codec import Message
from roles import loopback_config

S0, W0, W1 = 8, 9, 11


def _warm(policy: ReadinessPolicy, times: list[float], now: float = 0.0) -> None:
    """A lockstep round that gives every worker its estimate."""
    policy.start_round(now)
    for w, t in enumerate(times):
        policy.report_step(w, t, now + t)


# -- ReadinessPolicy.add ----------------------------------------------------------------------
def test_a_worker_back_counts_from_the_next_round_which_runs_in_lockstep():
    p = ReadinessPolicy(3)
    _warm(p, [0.1, 0.2, 5.0])
    p.start_round(10.0)
    p.remove(2)  # it died in round 2
    assert p.report_step(0, 0.1, 10.1) is False  # (the deadline is still worker 2's)
    assert p.is_ready(0, now=15.0) and p.report_step(1, 0.2, 15.0)
    assert p.round_complete()
    p.start_round(20.0)  # round 3: without it
    assert p.slowest() == 1 and p.round_complete() is False
    p.add(2)  # it joined during round 3: not in it
    assert p.is_ready(2)
    assert p.report_step(0, 0.1, 20.05) is False
    assert p.is_ready(0, now=20.15) and p.report_step(1, 0.2, 20.2)
    assert p.round_complete()
    p.start_round(30.0)  # round 4: with it, in lockstep (its old 5 s is forgotten)
    assert p.estimate(2) is None and p.slowest() is None
    assert p.report_step(0, 0.1, 30.1) and p.report_step(1, 0.2, 30.2)
    assert not p.round_complete()  # the round waits for it again
    assert p.report_step(2, 0.3, 30.3)
    assert p.round_complete()
    p.start_round(40.0)  # round 5: its new step time sets the deadline
    assert p.slowest() == 2 and p.deadline() == pytest.approx(40.3)
    assert p.report_step(0, 0.1, 40.1) is False


def test_a_worker_back_in_the_round_it_was_the_slowest_of_keeps_that_deadline():
    p = ReadinessPolicy(2)
    _warm(p, [1.0, 4.0])
    p.start_round(10.0)
    assert p.slowest() == 1
    p.remove(1)
    p.add(1)  # (back before the others finished the round)
    assert p.deadline() == 14.0 and p.is_ready(1)
    assert p.report_step(0, 1.0, 11.0) is False
    assert p.report_step(0, 1.0, 14.0) is True
    p.start_round(20.0)
    assert p.estimate(1) is None and p.slowest() is None


def test_adding_a_worker_checks_its_id():
    p = ReadinessPolicy(2)
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match="worker must be in 0..1"):
            p.add(bad)


# -- the state service and the scheduler's hook ---------------------------------------------
class _Sched:
    """What EsyncService.forget reads of the scheduler."""

    def __init__(self) -> None:
        self.nodes = {
            W0: NodeInfo(W0, "worker", 0, "127.0.0.1", 2),
            W1: NodeInfo(W1, "worker", 1, "127.0.0.1", 3),
        }
        self.left: dict[int, str] = {}


def test_the_state_service_counts_a_worker_back_from_its_next_round():
    svc, sched = EsyncService(2), _Sched()
    assert svc.decide(0, 1, 1.0, 1.0, 101.0)["ready"]  # round 1: lockstep
    assert svc.decide(1, 1, 4.0, 4.0, 104.0)["ready"]
    sched.left[W1] = "killed"
    svc.forget(sched)  # worker 1 is let go: worker 0 alone is the slowest
    assert svc.decide(0, 2, 1.0, 1.0, 111.0)["ready"]
    del sched.left[W1]
    svc.count_again(sched, sched.nodes[W1])
    svc.count_again(sched, NodeInfo(S0, "server", 0, "127.0.0.1", 1))  # (not a worker)
    assert svc.decide(0, 3, 1.0, 1.0, 121.0)["ready"]  # round 3: lockstep, worker 1 is in
    assert not svc.policy.round_complete()
    assert svc.decide(1, 3, 4.0, 4.0, 124.0)["ready"]
    # round 4: worker 1 (4 s) is the slowest again, worker 0 steps until its deadline
    ans = svc.decide(0, 4, 1.0, 1.0, 131.0)
    assert ans["ready"] is False and ans["deadline_in_s"] == pytest.approx(3.0)


@pytest.fixture
def sched():
    s = new_scheduler(loopback_config("scheduler", num_worker=2, elastic=1))
    s.nodes = {
        S0: NodeInfo(S0, "server", 0, "127.0.0.1", 1),
        W0: NodeInfo(W0, "worker", 0, "127.0.0.1", 2),
        W1: NodeInfo(W1, "worker", 1, "127.0.0.1", 3),
    }
    yield s
    s.van.close()


def test_the_scheduler_runs_the_hook_before_the_live_workers_go_on(sched):
    """``entered`` from the joiner: every on_worker_back hook is queued on the services'
    thread before the joiner and the live workers at their boundary are answered, so the
    hook runs before any report of the next round (the thread takes jobs in order)."""
    heard = []
    esync = EsyncService(2)
    sched.register(
        P.ESYNC_REPORT,
        lambda s, m: None,
        on_worker_back=lambda s, node: heard.append(("esync", node)) or esync.count_again(s, node),
    )
    sched.register(
        "other", lambda s, m: None, on_worker_back=lambda s, n: heard.append(("other", n))
    )
    sent = []
    sched.send_to = lambda nid, msg: sent.append(
        (nid, msg.cmd, msg.reply, sched._service_q.qsize())
    )
    esync.policy.remove(1)  # (as forget did when it was let go)
    sched.left[W1] = "killed"
    sched.workers_part.entering[W1] = {"worker": 4, "all": 4}
    sched.workers_part.admitting[W0] = Message(P.ADMIT, sender=W0, req=7)
    sched.workers_part.join_step(Message(P.ENTERED, sender=W1, req=9))
    replies = [(nid, cmd, queued) for nid, cmd, reply, queued in sent if reply]
    assert replies == [(W1, P.ENTERED, 2), (W0, P.ADMIT, 2)], sent
    assert (S0, P.WORKER_BACK, False, 2) in sent and (W0, P.WORKER_BACK, False, 2) in sent
    assert W1 not in sched.left and not sched.workers_part.admitting
    while not sched._service_q.empty():  # the services' thread's work, here
        sched._service_q.get()()
    assert heard == [("esync", sched.nodes[W1]), ("other", sched.nodes[W1])]
    esync.policy.start_round(0.0)
    assert not esync.policy.is_ready(1)  # counted again


def test_a_hook_for_a_command_served_already_is_refused(sched):
    sched.register("x", lambda s, m: None)
    with pytest.raises(ValueError, match="already has a service"):
        sched.register("x", lambda s, m: None, on_worker_back=lambda s, n: None)
    assert sched._on_worker_back == []


# -- the trainer of a joiner ------------------------------------------------------------------
class _KV:
    """What ESyncTrainer uses of a DistKVStore: one worker's sums are its own values."""

    node = object()

    def __init__(self, rejoining: bool = False) -> None:
        self.num_workers = 1
        self.rejoining = rejoining
        self.joining = False
        self.calls: list[tuple[str, list]] = []

    def init(self, keys, values) -> None:
        self.calls.append(("init", list(keys)))

    def declare(self, keys, values) -> None:
        self.calls.append(("declare", list(keys)))

    def pull(self, keys, out=None) -> None:
        self.calls.append(("pull", list(keys)))

    def pushpull(self, keys, values) -> None:
        self.calls.append(("pushpull", list(keys)))

    def short_rounds(self, key) -> list:
        return []


def _model(width: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, width)


def test_a_joiner_makes_no_broadcast_and_declares_the_keys_that_exist():
    live, joiner = _KV(), _KV(rejoining=True)
    ESyncTrainer(_model(), live)
    ESyncTrainer(_model(), joiner)
    assert [c for c, _ in live.calls] == ["init", "pull", "init"]  # broadcast, then the keys
    assert joiner.calls == [("declare", ["round:float32"])]
    assert live.calls[-1] == ("init", ["round:float32"])


def test_a_joiner_adopts_the_live_workers_round():
    live = ESyncTrainer(_model(), _KV())
    live.rounds = 7
    joiner = ESyncTrainer(_model(), _KV(rejoining=True))
    joiner.adopt(live.join_state())
    assert joiner.rounds == 7 and joiner.begin_round() == 8
    with pytest.raises(ValueError, match="the model .or the prefix. differs"):
        ESyncTrainer(_model(4), _KV(rejoining=True)).adopt(live.join_state())
    for bad in (None, {}, {"rounds": -1}, {"rounds": True}, {"rounds": "7"}):
        with pytest.raises(ValueError, match="join_state"):
            joiner.adopt(bad)


def test_the_join_flag_travels_with_the_rounds_sum():
    kv = _KV()
    trainer = ESyncTrainer(_model(), kv)
    for joining in (False, True, False):
        kv.joining = joining
        trainer.begin_round()
        assert trainer.aggregate(ctl=0.0) is False
        assert trainer.admit_due is joining
