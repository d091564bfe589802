"""A worker that leaves mid-round (HETPS_ELASTIC), message by message: one KVServer with a
node wired by hand, so the orders that a death makes possible are played exactly (the
processes and the kill are in tests/integration/test_elastic_workers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hetps import optim
from hetps.kvstore.server import KVServer
from hetps.roles import new_server
from hetps.transport.codec import Message

S_ID, W0, W1, W2 = 8, 9, 11, 13
CHUNK = 4  # elements per chunk: a key of 8 is pushed as two chunks


class _Node:
    """What KVServer reads of its node: three workers, HETPS_ELASTIC=2, and who left."""

    id = S_ID
    elastic = 2
    replicas = 1
    on_failover = on_rejoin = on_worker_left = None

    def __init__(self) -> None:
        self.left: set[int] = set()
        self.replies: list[tuple[Message, dict | None, list]] = []

    def role_of(self, nid):
        return "worker" if nid in (W0, W1, W2) else None

    def workers(self):
        return [W0, W1, W2]

    def live_workers(self):
        return [w for w in (W0, W1, W2) if w not in self.left]

    def describe(self, nid):
        return f"node {nid}"

    def reply(self, msg, body=None, arrays=None, track=False):
        self.replies.append((msg, body, [np.array(a, copy=True) for a in arrays or []]))

    def send(self, peer, msg):
        return True

    def leave(self, srv: KVServer, worker: int) -> None:
        """What Node does on worker_left: remember it, then tell the server."""
        self.left.add(worker)
        srv.elastic.on_worker_left(worker)


def _server(optimizer: optim.Optimizer | None = None) -> tuple[KVServer, _Node]:
    node = _Node()
    srv = new_server(node)
    body = {"k": "w", "part": 0, "off": 0, "n": 8, "size": 8, "shape": [8], "dtype": "float32"}
    srv.handle(Message("init", sender=W0, req=1, body=body, arrays=[np.zeros(8, np.float32)]))
    if optimizer is not None:
        blob = np.frombuffer(optim.dumps(optimizer), np.uint8)
        srv.handle(Message("set_optimizer", sender=W0, req=2, arrays=[blob]))
    node.replies.clear()
    return srv, node


def _push(srv: KVServer, worker: int, value: float, req: int, off: int | None = None) -> None:
    """A fused push-pull of the key (both chunks, or only the one at ``off``)."""
    for o in (0, CHUNK) if off is None else (off,):
        body = {"k": "w", "part": 0, "off": o, "n": CHUNK, "sync": True, "ce": CHUNK, "pp": True}
        grad = np.full(CHUNK, value, np.float32)
        srv.handle(Message("push", sender=worker, req=req, body=body, arrays=[grad]))


def _answers(node: _Node) -> dict[int, list[tuple[int, np.ndarray, int | None]]]:
    """Per worker, the push answers: (offset, value, workers summed when fewer)."""
    out: dict[int, list] = {}
    for msg, body, arrays in node.replies:
        assert body is None or "error" not in body, body
        out.setdefault(msg.sender, []).append((msg.body["off"], arrays[0], (body or {}).get("w")))
    return out


def test_a_dead_workers_half_round_is_dropped_and_the_round_ends_without_it():
    """W2 pushed one of the two chunks and died: its chunk is not in the sum, the round
    completes when the others' pushes are in, and the answers say 2 workers."""
    srv, node = _server()
    _push(srv, W0, 1.0, req=10)
    _push(srv, W2, 100.0, req=30, off=0)  # half its round, then it dies
    assert node.replies == []
    node.leave(srv, W2)
    assert node.replies == []  # W1 has not pushed yet
    _push(srv, W1, 2.0, req=20)
    answers = _answers(node)
    assert sorted(answers) == [W0, W1]
    for worker in (W0, W1):
        for _off, value, w in answers[worker]:
            assert np.array_equal(value, np.full(CHUNK, 3.0, np.float32))
            assert w == 2
    sl = srv.slices[("w", 0)]
    assert sl.rounds == 1 and np.array_equal(sl.value, np.full(8, 3.0, np.float32))


def test_the_leave_completes_a_round_that_waited_only_for_the_dead_worker():
    srv, node = _server()
    _push(srv, W0, 1.0, req=10)
    _push(srv, W1, 2.0, req=20)
    _push(srv, W2, 100.0, req=30, off=CHUNK)
    assert node.replies == []
    node.leave(srv, W2)
    assert sorted(_answers(node)) == [W0, W1]
    assert np.array_equal(srv.slices[("w", 0)].value, np.full(8, 3.0, np.float32))
    # the next round: two workers make it complete, still a sum of 2
    node.replies.clear()
    _push(srv, W0, 1.0, req=11)
    _push(srv, W1, 1.0, req=21)
    assert all(w == 2 for ans in _answers(node).values() for _, _, w in ans)
    assert np.array_equal(srv.slices[("w", 0)].value, np.full(8, 2.0, np.float32))


def test_a_round_of_every_worker_says_nothing_of_fewer_workers():
    srv, node = _server()
    for worker, v in ((W0, 1.0), (W1, 2.0), (W2, 3.0)):
        _push(srv, worker, v, req=worker)
    answers = _answers(node)
    assert sorted(answers) == [W0, W1, W2]
    assert all(w is None for ans in answers.values() for _, _, w in ans)
    assert np.array_equal(srv.slices[("w", 0)].value, np.full(8, 6.0, np.float32))


def test_the_sum_is_in_worker_order_whatever_the_arrival_order():
    """Pushes are kept apart and added in worker order when the round is complete, so the
    float sum does not depend on which push came first."""
    values = {W0: 1e8, W1: 1.0, W2: -1e8}
    results = []
    for order in ((W0, W1, W2), (W0, W2, W1), (W2, W0, W1)):  # in float32: 0, 1, 1 as they come
        srv, _ = _server()
        for worker in order:
            _push(srv, worker, values[worker], req=worker)
        results.append(srv.slices[("w", 0)].value.copy())
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_a_push_from_a_worker_that_left_is_refused_and_changes_nothing():
    srv, node = _server()
    node.leave(srv, W2)
    _push(srv, W2, 100.0, req=30, off=0)  # (sent before it died, arrived after the leave)
    ((msg, body, _),) = node.replies
    assert "left the job" in body["error"]
    node.replies.clear()
    _push(srv, W0, 1.0, req=10)
    _push(srv, W1, 2.0, req=20)
    assert np.array_equal(srv.slices[("w", 0)].value, np.full(8, 3.0, np.float32))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_with_a_server_optimizer_the_survivors_sum_is_scaled_to_the_job(momentum):
    """A server optimizer's rescale_grad is set for the job's workers: the survivors' sum is
    scaled by 3/2, so the step is the one the job's mean gradient would make."""
    srv, node = _server(optim.SGD(learning_rate=0.5, momentum=momentum))
    node.leave(srv, W2)
    _push(srv, W0, 1.0, req=10)
    _push(srv, W1, 2.0, req=20)
    # SGD: w -= lr * grad, grad = (1 + 2) * 3 / 2
    assert np.allclose(srv.slices[("w", 0)].value, -0.5 * 4.5)
    assert all(w is None for ans in _answers(node).values() for _, _, w in ans)  # weights


def test_the_workers_mean_divides_a_short_range_by_its_own_workers():
    """DistributedOptimizer's SSGD mean: the job's 3 workers, except where the store says a
    range holds the sum of 2 (a worker left in that round)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from hetps.torch.optimizer import DistributedOptimizer

    fake = SimpleNamespace(
        kv=SimpleNamespace(short_rounds=lambda key: [(2, 5, 2)] if key == "g0" else []),
        _key=lambda g: g.key,
    )
    total = torch.full((6,), 6.0)
    DistributedOptimizer._mean(fake, SimpleNamespace(key="g0"), total, 3)
    assert total.tolist() == [2.0, 2.0, 3.0, 3.0, 3.0, 2.0]
    other = torch.full((6,), 6.0)
    DistributedOptimizer._mean(fake, SimpleNamespace(key="g1"), other, 3)
    assert other.tolist() == [2.0] * 6


def test_esync_readiness_leaves_out_a_worker_that_left():
    """A worker that left is ready in every round and never the slowest: the round ends
    when the others are ready, and the slowest of the others sets the deadline."""
    from hetps.esync.policy import ReadinessPolicy

    policy = ReadinessPolicy(3)
    policy.start_round(0.0)
    for w, step in ((0, 0.1), (1, 0.2), (2, 5.0)):
        policy.report_step(w, step, step)
    policy.start_round(10.0)
    assert policy.slowest() == 2
    policy.remove(2)
    assert not policy.round_complete()
    assert policy.report_step(0, 0.1, 10.1) is False  # the deadline is still worker 2's
    policy.start_round(20.0)
    assert policy.slowest() == 1  # the slowest of those left
    assert policy.report_step(0, 0.1, 20.05) is False  # another step ends before 20.2
    assert policy.is_ready(0, now=20.15)
    assert not policy.round_complete()
    assert policy.report_step(1, 0.2, 20.2) is True
    assert policy.round_complete()


def test_a_worker_out_of_the_rounds_cannot_init_or_set_the_optimizer_until_it_enters():
    """A let-go worker (or one started again, before it joined) would reset a key's value
    and round count with an init: refused. After ``enter`` it is counted again (twice is
    harmless)."""
    srv, node = _server()
    node.leave(srv, W2)
    body = {"k": "w", "part": 0, "off": 0, "n": 8, "size": 8, "shape": [8], "dtype": "float32"}
    srv.handle(Message("init", sender=W2, req=5, body=body, arrays=[np.ones(8, np.float32)]))
    blob = np.frombuffer(optim.dumps(optim.SGD(learning_rate=1.0)), np.uint8)
    srv.handle(Message("set_optimizer", sender=W2, req=6, arrays=[blob]))
    errors = [body["error"] for _, body, _ in node.replies]
    assert len(errors) == 2 and all("not in the job's rounds" in e for e in errors), errors
    assert np.array_equal(srv.slices[("w", 0)].value, np.zeros(8, np.float32))
    assert srv.optimizer is None
    node.replies.clear()
    revived = []
    node.revive = revived.append
    for req in (7, 8):
        srv.handle(Message("enter", sender=W2, req=req))
    assert [body for _, body, _ in node.replies] == [{}, {}]
    assert revived == [W2, W2]  # the van takes it as alive again
    assert W2 not in node.left
    node.replies.clear()
    for worker, v in ((W0, 1.0), (W1, 2.0), (W2, 3.0)):  # three workers again
        _push(srv, worker, v, req=worker)
    assert np.array_equal(srv.slices[("w", 0)].value, np.full(8, 6.0, np.float32))
