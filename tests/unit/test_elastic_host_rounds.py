"""Host-local aggregation's pushes in a server's elastic rounds (HETPS_ELASTIC), message by
message: a host's sum stands for its workers, a refused push stands for nobody, a part sent
again for a round the server applied is only answered with the value, and a round after a
local worker left holds the workers left (docs/HOSTS.md, Faults)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hetps.roles import new_server
from hetps.transport.codec import Message

S_ID, W0, W1, W2 = 8, 9, 11, 13
GROUP = {W0: 0, W1: 0, W2: 1}  # host 0 runs W0 and W1 (local ranks 0, 1), host 1 runs W2
CHUNK = 4


class _Node:
    """What KVServer reads of its node: three workers on two hosts, HETPS_ELASTIC=2."""

    id = S_ID
    elastic = 2
    replicas = 1
    on_failover = on_rejoin = on_worker_left = None

    def __init__(self) -> None:
        self.left: set[int] = set()
        self.replies: list[tuple[Message, dict | None, list]] = []

    def role_of(self, nid):
        return "worker" if nid in GROUP else None

    def workers(self):
        return [SimpleNamespace(id=w, group=GROUP[w]) for w in GROUP]

    def live_workers(self):
        return [n for n in self.workers() if n.id not in self.left]

    def describe(self, nid):
        return f"node {nid}"

    def reply(self, msg, body=None, arrays=None, track=False):
        self.replies.append((msg, body, [np.array(a, copy=True) for a in arrays or []]))

    def send(self, peer, msg):
        return True


def _server():
    node = _Node()
    srv = new_server(node)
    body = {"k": "w", "part": 0, "off": 0, "n": 8, "size": 8, "shape": [8], "dtype": "float32"}
    srv.handle(Message("init", sender=W0, req=1, body=body, arrays=[np.zeros(8, np.float32)]))
    node.replies.clear()
    return srv, node


def _push(srv, worker, value, host, rnd=None, ce=CHUNK):
    """A fused push-pull of the key in chunks of ``ce``, tagged with ``host``."""
    for o in range(0, 8, ce):
        body = {"k": "w", "part": 0, "off": o, "n": ce, "sync": True, "ce": ce, "pp": True,
                "hg": list(host), **({"rnd": rnd} if rnd is not None else {})}  # fmt: skip
        grad = np.full(ce, value, np.float32)
        srv.handle(Message("push", sender=worker, req=worker, body=body, arrays=[grad]))


def _answers(node):
    """Per worker: (value answered, workers summed when fewer), errors apart."""
    out, errors = {}, []
    for msg, body, arrays in node.replies:
        if body and "error" in body:
            errors.append(body["error"])
            continue
        out.setdefault(msg.sender, []).append((float(arrays[0][0]), (body or {}).get("w")))
    node.replies.clear()
    return out, errors


def test_a_hosts_sum_stands_for_its_workers_and_a_refused_push_for_nobody():
    srv, node = _server()
    _push(srv, W2, 100.0, (1, 0, 1))
    _push(srv, W0, 3.0, (0, 0, 2), ce=2)  # chunks that do not fit the round's: refused
    got, errors = _answers(node)
    assert got == {} and errors and "HETPS_CHUNK_BYTES" in errors[0], errors
    assert W0 not in srv.slices[("w", 0)].hosts  # (it stands for nobody: no round ends)
    _push(srv, W0, 3.0, (0, 0, 2))  # host 0's sum of W0 and W1
    got, errors = _answers(node)
    assert errors == [] and got == {W0: [(103.0, None)] * 2, W2: [(103.0, None)] * 2}, got


def test_a_part_sent_again_for_an_applied_round_is_answered_and_the_next_round_is_short():
    srv, node = _server()
    _push(srv, W1, 3.0, (0, 1, 2), rnd=0)  # W1 sends host 0's sum, then dies unanswered
    _push(srv, W2, 100.0, (1, 0, 1), rnd=0)
    assert _answers(node)[0] == {W1: [(103.0, None)] * 2, W2: [(103.0, None)] * 2}
    node.left.add(W1)
    srv.elastic.on_worker_left(W1)
    _push(srv, W0, 3.0, (0, 0, 2), rnd=0)  # W0 took its part over: round 0 was applied
    got, errors = _answers(node)
    assert errors == [] and got == {W0: [(103.0, None)] * 2}, got
    sl = srv.slices[("w", 0)]
    assert sl.rounds == 1 and sl.got == {}
    _push(srv, W0, 5.0, (0, 0, 1), rnd=1)  # host 0 now stands for W0 alone
    _push(srv, W2, 10.0, (1, 0, 1), rnd=1)
    got, errors = _answers(node)
    assert errors == [] and got == {W0: [(15.0, 2)] * 2, W2: [(15.0, 2)] * 2}, got
