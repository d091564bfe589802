"""The identity checks below the network tests: replies, pickles, shared-memory rings."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hetps import optim
from hetps.cluster.errors import RequestError
from hetps.cluster.requests import RequestTracker
from hetps.roles import new_server
from hetps.transport import shm
from hetps.transport.codec import Message


def test_a_reply_is_taken_only_from_the_peer_that_was_asked():
    rt = RequestTracker()
    fut = rt.new(8, "pull from server 8")
    assert not rt.resolve(fut.req, Message("pull", reply=True), sender=9)  # another node
    assert not fut.done()
    assert rt.resolve(fut.req, Message("pull", reply=True), sender=8)
    assert fut.wait(1).cmd == "pull"
    fut = rt.new(8, "pull")
    assert rt.resolve(fut.req, None, "bad key", sender=8)
    with pytest.raises(RequestError, match="bad key"):
        fut.wait(1)


class _Node:
    def __init__(self, roles: dict[int, str]) -> None:
        self.roles = roles
        self.replies: list[tuple[Message, dict | None]] = []

    def role_of(self, node_id: int) -> str | None:
        return self.roles.get(node_id)

    def workers(self) -> list:
        return [n for n, r in self.roles.items() if r == "worker"]

    def reply(self, msg, body=None, arrays=None, track=False):
        self.replies.append((msg, body))


def test_the_server_unpickles_only_a_registered_workers_pickle(tmp_path):
    """Behind the node's allow-list, the server checks again before it unpickles."""
    node = _Node({9: "worker", 8: "server", 1: "scheduler"})
    srv = new_server(node)
    blob = np.frombuffer(optim.dumps(optim.SGD(learning_rate=0.5)), np.uint8)
    states = np.frombuffer(optim.dump_states({}), np.uint8)
    for sender in (0, 1, 8, 12345):  # nobody, the scheduler, a server, an unknown id
        srv.handle(Message("set_optimizer", sender=sender, req=1, arrays=[blob]))
        srv.handle(Message("set_states", sender=sender, req=2, arrays=[states]))
        assert srv.optimizer is None
        errors = [b["error"] for _, b in node.replies[-2:]]
        assert "only a worker of this job" in errors[0] and "only a worker" in errors[1]
    srv.handle(Message("set_optimizer", sender=9, req=3, arrays=[blob]))
    assert isinstance(srv.optimizer, optim.SGD) and node.replies[-1][1] is None


def test_a_ring_that_is_not_a_private_file_of_this_user_is_refused(tmp_path):
    name = "hetps-shm-1-" + "ab" * 16
    path = tmp_path / name
    path.write_bytes(bytes(shm.HEADER_BYTES + 4096))
    os.chmod(path, 0o644)  # others may read it
    with pytest.raises(ValueError, match="not a private file"):
        shm.InRing(name, directory=str(tmp_path))
    os.unlink(path)
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(shm.HEADER_BYTES + 4096))
    os.chmod(target, 0o600)
    os.symlink(target, path)  # a link planted under a ring's name
    with pytest.raises(OSError):
        shm.InRing(name, directory=str(tmp_path))


def test_ring_names_hold_128_random_bits():
    ring = shm.OutRing(4096)
    try:
        assert shm.NAME_RE.match(ring.name) and len(ring.name.rsplit("-", 1)[1]) == 32
        mode = os.stat(os.path.join(shm.SHM_DIR, ring.name)).st_mode & 0o777
        assert mode == 0o600
    finally:
        ring.close()


def test_a_push_must_be_a_chunk_of_its_part_once_per_round():
    """Overlapping or repeated chunks would leave part of the merge buffer unwritten (and
    its old heap bytes would become the key's value): each is refused."""
    node = _Node({9: "worker", 11: "worker"})
    srv = new_server(node)
    body = {"k": "w", "part": 0, "size": 8, "shape": [8], "dtype": "float32"}
    srv.handle(Message("init", sender=9, req=1, body={**body, "off": 0, "n": 8},
                       arrays=[np.zeros(8, np.float32)]))  # fmt: skip

    def push(sender, off, n, ce=4, req=2):
        b = {"k": "w", "part": 0, "off": off, "n": n, "sync": True, "ce": ce}
        srv.handle(Message("push", sender=sender, req=req, body=b,
                           arrays=[np.full(n, sender, np.float32)]))  # fmt: skip
        return node.replies[-1][1] if node.replies else None

    assert "not a chunk of 4" in push(9, 2, 4)["error"]  # misaligned
    assert "not a chunk of 4" in push(9, 0, 3)["error"]  # short
    assert "'ce'" in push(9, 0, 4, ce=0)["error"]
    n_before = len(node.replies)
    push(9, 0, 4)  # accepted: waits for the round
    assert len(node.replies) == n_before
    assert "pushed twice in one round" in push(9, 0, 4, req=3)["error"]
    push(9, 4, 4, req=4)
    push(11, 0, 4, req=5)
    push(11, 4, 4, req=6)  # the round completes: 9 + 11 everywhere, nothing unwritten
    assert (srv.slices[("w", 0)].value == 20).all()
