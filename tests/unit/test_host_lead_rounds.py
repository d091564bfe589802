"""A host's leader (cluster/hostlead.py) relays every link report of every local worker, also
when a worker goes on to its next round before a local worker's report of the last one was
read (reports are pipelined: a worker waits for a round's answer one round later). Its own
report of that round goes on its own then, not overwritten by the next: lost, the scheduler
would never answer that round and every worker of the job would wait for it."""

from __future__ import annotations

import socket
import time
import types

import numpy as np
import pytest

from hetps.cluster import hostlead as H
from hetps.cluster import protocol as P
from hetps.cluster.requests import Future
from hetps.transport.codec import Message

LEADER, FOLLOWER = 9, 11
SECRET = b"r" * 32


class _Node:
    """What HostLead uses of a worker's Node; the scheduler's requests are recorded."""

    def __init__(self) -> None:
        cfg = {"host_control": True, "request_timeout": 5.0, "colocate": True, "replan_every": 1}
        self.cfg = types.SimpleNamespace(secret=SECRET, **cfg)
        self.info = P.NodeInfo(LEADER, "worker", 0, "", 0, 0)
        self.nodes = {i: P.NodeInfo(i, "worker", r, "", 0, 0) for r, i in enumerate((9, 11))}
        self.left: set[int] = set()
        self.sent: list[Message] = []

    def check(self) -> None:
        pass

    def request(self, to: int, msg: Message, callback=None) -> Future:
        self.sent.append(msg)
        return Future(len(self.sent), to, msg.cmd, callback)


def _wait_for(cond, what: str) -> None:
    end = time.monotonic() + 5.0
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def _report(rnd: int, seed: int) -> Message:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((3, 6)), rng.standard_normal((2, 3))]
    return Message(P.BALANCE_REPORT, body={"round": rnd}, arrays=arrays)


@pytest.mark.parametrize("ahead", ["leader", "follower"])
def test_a_report_left_waiting_when_its_worker_went_on_is_still_relayed(ahead, caplog):
    node = _Node()
    lead = H.HostLead(node)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(H._name(SECRET, 0, LEADER))
        H._send(sock, {"id": FOLLOWER})
        _wait_for(lambda: FOLLOWER in lead.conns, "the follower was not accepted")
        # one worker reports rounds 1 and 2 before the other's report of round 1 is read
        mine = {rnd: _report(rnd, rnd) for rnd in (1, 2)}
        theirs = {rnd: _report(rnd, 10 + rnd) for rnd in (1, 2)}

        def leader_reports() -> None:
            lead.report(1, mine[1])
            lead.report(2, mine[2])

        def follower_reports() -> None:
            for rnd in (1, 2):
                w = theirs[rnd].arrays
                H._send(sock, {"k": H.REPORT, "n": rnd, "w": {"b": {}, "s": w[0].tobytes(),
                                                               "t": w[1].tobytes()}})  # fmt: skip
            _wait_for(lambda: lead.sent.get(H.REPORT, {}).get(FOLLOWER, 0) >= 1,
                      "the follower's round 1 was not relayed when it went on")  # fmt: skip

        first, then = (leader_reports, follower_reports)
        if ahead == "follower":
            first, then = then, first
        first()
        then()
        got: dict[tuple[int, int], list[np.ndarray]] = {}

        def every_report() -> bool:
            for msg in list(node.sent):
                at = np.cumsum([0, *(s for s, _ in msg.body["host_rows"])])
                tt = np.cumsum([0, *(t for _, t in msg.body["host_rows"])])
                for j, nid in enumerate(msg.body["host"]):
                    rows = [msg.arrays[0][at[j] : at[j + 1]], msg.arrays[1][tt[j] : tt[j + 1]]]
                    got[(nid, msg.body["round"])] = rows
            return len(got) == 4

        end = time.monotonic() + 5.0
        while not every_report() and time.monotonic() < end:
            time.sleep(0.01)  # (the leader's thread reads the follower's reports)
        assert sorted(got) == [(LEADER, 1), (LEADER, 2), (FOLLOWER, 1), (FOLLOWER, 2)]
        assert "dropped" not in caplog.text  # (a follower going on is no off-round one)
        # every worker's report of every round, with its own values
        for (nid, rnd), rows in got.items():
            want = (mine if nid == LEADER else theirs)[rnd].arrays
            for a, b in zip(rows, want, strict=True):
                np.testing.assert_array_equal(a, b)
    finally:
        sock.close()
        lead.close()


def test_a_follower_cannot_run_rounds_ahead_without_bound(caplog):
    """A follower that goes on round after round while this worker reports none is kept
    AHEAD rounds past it (a synchronous job's workers are a round or two apart), then dropped,
    naming the round: the leader does not relay a stream of future rounds for it."""
    node = _Node()
    lead = H.HostLead(node)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(H._name(SECRET, 0, LEADER))
        H._send(sock, {"id": FOLLOWER})
        _wait_for(lambda: FOLLOWER in lead.conns, "the follower was not accepted")
        for rnd in range(1, H.AHEAD + 3):
            w = _report(rnd, rnd).arrays
            H._send(sock, {"k": H.REPORT, "n": rnd, "w": {"b": {}, "s": w[0].tobytes(),
                                                           "t": w[1].tobytes()}})  # fmt: skip
        _wait_for(lambda: FOLLOWER not in lead.conns, "a follower running ahead was kept")
        assert f"dropped worker {FOLLOWER}, which sent round {H.AHEAD + 1} of 'r'" in caplog.text
        # the rounds it had before: relayed on their own as it went on, the last one dropped
        assert [m.body["round"] for m in node.sent] == list(range(1, H.AHEAD))
    finally:
        sock.close()
        lead.close()
