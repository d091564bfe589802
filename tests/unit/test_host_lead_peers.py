"""A host's leader (cluster/hostlead.py) against a broken follower on its real abstract Unix
socket: a link report whose arrays are not whole rows, or whose body is no map, drops that
follower only; the leader's own report goes on (all its values) and a well-formed follower
is relayed after it, in either order of arrival. And a follower against a broken leader: half
an answer, or what is no answer, and it sends its own. And rounds: a report left waiting when
its worker went on is relayed; a follower far ahead is dropped."""

from __future__ import annotations

import fcntl
import os
import resource
import select
import socket
import threading
import time
import types

import numpy as np
import pytest

from hetps.cluster import hostlead as H
from hetps.cluster import protocol as P
from hetps.cluster.requests import Future
from hetps.transport.codec import Message

LEADER, FOLLOWER = 9, 11
SECRET = b"k" * 32


class _Node:
    """What HostLead uses of a worker's Node; the scheduler's requests are recorded."""

    def __init__(self) -> None:
        # colocate: rows go as they are (the merge per host has its own test)
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


def _follower() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(H._name(SECRET, 0, LEADER))
    H._send(sock, {"id": FOLLOWER})
    return sock


def _frame(sock: socket.socket) -> bytes:
    (size,) = H._LEN.unpack(sock.recv(H._LEN.size, socket.MSG_WAITALL))
    return sock.recv(size, socket.MSG_WAITALL)


def _report(rnd: int, seed: int, rows: int = 3) -> Message:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((rows, 6)), rng.standard_normal((2, 3))]
    return Message(P.BALANCE_REPORT, body={"round": rnd}, arrays=arrays)


def _send_report(sock: socket.socket, rnd: int, msg: Message) -> None:
    """A follower's hand of its link report ``msg`` of round ``rnd`` to its leader."""
    what = {"b": {}, "s": msg.arrays[0].tobytes(), "t": msg.arrays[1].tobytes()}
    H._send(sock, {"k": H.REPORT, "n": rnd, "w": what})


def _wait_for(cond, what: str) -> None:
    end = time.monotonic() + 5.0
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


@pytest.fixture
def lead():
    node = _Node()
    hl = H.HostLead(node)
    yield hl
    hl.close()


BROKEN = [
    {"b": {}, "s": b"abc", "t": b""},  # samples not whole float64 rows
    {"b": {}, "s": b"", "t": bytes(16)},  # times not whole rows of three
    {"b": 5, "s": b"", "t": b""},  # a body that is no map
    7,  # no report at all
]


@pytest.mark.parametrize("first", ["follower", "leader"])
@pytest.mark.parametrize("what", BROKEN, ids=["samples", "times", "body", "int"])
def test_a_broken_report_drops_that_follower_and_the_host_goes_on(lead, first, what):
    node = lead.node
    bad = _follower()
    _wait_for(lambda: FOLLOWER in lead.conns, "the follower was not accepted")
    mine = _report(1, 0)
    if first == "follower":
        H._send(bad, {"k": H.REPORT, "n": 1, "w": what})
        assert bad.recv(1) == b""  # dropped: EOF
        lead.report(1, mine)
    else:
        lead.report(1, mine)
        H._send(bad, {"k": H.REPORT, "n": 1, "w": what})
        assert bad.recv(1) == b""
    bad.close()
    _wait_for(lambda: node.sent, "the leader's own report was never sent")
    (sent,) = node.sent
    assert sent.body["host"] == [LEADER]
    for got, want in zip(sent.arrays, mine.arrays, strict=True):
        np.testing.assert_array_equal(got, want)
    # a well-formed follower after it is relayed with the leader, every value in order
    good = _follower()
    _wait_for(lambda: FOLLOWER in lead.conns, "the next follower was not accepted")
    theirs = _report(2, 1)
    _send_report(good, 2, theirs)
    mine2 = _report(2, 2)
    lead.report(2, mine2)
    _wait_for(lambda: len(node.sent) == 2, "the host's report of round 2 was never sent")
    assert lead.thread.is_alive()
    merged = node.sent[1]
    assert merged.body["host"] == [LEADER, FOLLOWER]
    assert merged.body["host_rows"] == [[3, 2], [3, 2]]
    for i in range(2):
        want = np.concatenate([mine2.arrays[i], theirs.arrays[i]])
        np.testing.assert_array_equal(merged.arrays[i], want)
    good.close()


@pytest.mark.parametrize("theirs", [True, False])
def test_a_hosts_report_says_one_push_only_if_each_of_its_workers_does(lead, theirs):
    """The leader's worker sums through its host (``one_push``); its follower does too, or
    pushes its own (started again): the host's one report says one push only in the first."""
    node, good = lead.node, _follower()
    try:
        _wait_for(lambda: FOLLOWER in lead.conns, "the follower was not accepted")
        msg = _report(1, 1)
        what = {"b": {"round": 1, **({"one_push": True} if theirs else {})}}
        H._send(good, {"k": H.REPORT, "n": 1, "w": {**what, "s": msg.arrays[0].tobytes(),
                                                    "t": msg.arrays[1].tobytes()}})  # fmt: skip
        mine = _report(1, 0)
        mine.body["one_push"] = True
        lead.report(1, mine)
        _wait_for(lambda: node.sent, "the host's report was never sent")
        (sent,) = node.sent
        assert sent.body["host"] == [LEADER, FOLLOWER]
        assert sent.body.get("one_push", False) is theirs
    finally:
        good.close()


def test_a_hello_that_is_no_worker_id_is_refused(lead):
    """A local connection whose first frame is no Hello (the id as text, an unknown field,
    no map) is closed and never counted as a follower; a good one after it is."""
    for hello in ({"id": str(FOLLOWER)}, {"id": FOLLOWER, "x": 1}, [FOLLOWER]):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        try:
            sock.connect(H._name(SECRET, 0, LEADER))
            H._send(sock, hello)
            assert sock.recv(1) == b"", hello  # closed
        finally:
            sock.close()
        assert FOLLOWER not in lead.conns
    good = _follower()
    _wait_for(lambda: FOLLOWER in lead.conns, "a good follower was not accepted")
    good.close()


# -- a hostile follower: it must not hold the host's other workers ---------------------------
OTHER = 13


class _Host3(_Node):
    """Three workers on the host (9 leads; 11 hostile, 13 well-formed); the scheduler's
    requests are kept so that a test answers them."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes[OTHER] = P.NodeInfo(OTHER, "worker", 2, "", 0, 0)
        self.futures: list[Future] = []

    def request(self, to: int, msg: Message, callback=None) -> Future:
        self.futures.append(super().request(to, msg, callback))
        return self.futures[-1]


@pytest.fixture
def lead3():
    hl = H.HostLead(_Host3())
    yield hl
    hl.close()


def _hello(nid: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(H._name(SECRET, 0, LEADER))
    H._send(sock, {"id": nid})
    return sock


def _hands(lead, good: socket.socket) -> tuple[Message, Message, H.Relayed]:
    """The well-formed follower's round-1 report, handed to the leader, and the leader's."""
    theirs, mine = _report(1, 1), _report(1, 2)
    _send_report(good, 1, theirs)
    return theirs, mine, lead.report(1, mine)


def _the_others_go_on(lead, hostile: socket.socket, good: socket.socket, hands) -> None:
    """The leader's and the good follower's round-1 reports go as one, every value theirs;
    the scheduler's answer reaches the good follower; the hostile one is dropped (EOF)."""
    node = lead.node
    theirs, mine, relayed = hands
    assert hostile.recv(1) == b""  # dropped
    _wait_for(lambda: node.sent, "the host's report was never sent")
    (sent,) = node.sent
    assert sent.body["host"] == [LEADER, OTHER]
    for i in range(2):
        want = np.concatenate([mine.arrays[i], theirs.arrays[i]])
        np.testing.assert_array_equal(sent.arrays[i], want)
    plan = b"the packed plan"
    node.futures[0].set_result(
        Message(P.BALANCE_REPORT, reply=True, typed=H.BalanceAnswer(plan=plan))
    )
    told = H._DECODERS[H.Told].decode(_frame(good))
    assert (told.k, told.n, told.ok, told.a.plan) == (H.REPORT, 1, True, plan)
    assert relayed.wait(5.0).typed.plan == plan
    assert lead.thread.is_alive()


def test_half_a_frame_drops_that_follower_and_the_others_go_on(lead3, monkeypatch, caplog):
    """A follower that sends part of a frame and stops holds no one: the leader reads the
    others meanwhile, and drops it once its frame is not whole within the deadline."""
    monkeypatch.setattr(H, "_FRAME_S", 60.0)
    hostile, good = _hello(FOLLOWER), _hello(OTHER)
    try:
        _wait_for(lambda: {FOLLOWER, OTHER} <= set(lead3.conns), "followers not accepted")
        hostile.sendall(H._LEN.pack(1000) + bytes(10))  # 10 bytes of a 1,000-byte frame
        hands = _hands(lead3, good)
        _wait_for(lambda: OTHER in lead3.pending.get(H.REPORT, {}), "the good hand was not read")
        assert FOLLOWER in lead3.conns  # (read while the hostile frame is still unfinished)
        monkeypatch.setattr(H, "_FRAME_S", 0.0)  # its deadline is past
        _the_others_go_on(lead3, hostile, good, hands)
    finally:
        hostile.close()
        good.close()
    assert f"dropped worker {FOLLOWER}, which sent part of a frame" in caplog.text


@pytest.mark.parametrize("when", ["first", "while-the-host-waits"])
@pytest.mark.parametrize("rnd", [2, 10**15], ids=["next-but-one", "huge"])
def test_a_round_that_is_not_the_hosts_drops_that_follower(lead3, rnd, when, caplog):
    """A follower's hand at a round that is neither the host's current nor its next (ahead
    by one, or a huge number), before the others' or while the host waits for it at round 1,
    is refused, naming it and the round; the others go on."""
    hostile, good = _hello(FOLLOWER), _hello(OTHER)
    try:
        _wait_for(lambda: {FOLLOWER, OTHER} <= set(lead3.conns), "followers not accepted")
        bad = _report(rnd, 3)
        what = {"b": {}, "s": bad.arrays[0].tobytes(), "t": bad.arrays[1].tobytes()}
        if when == "first":
            H._send(hostile, {"k": H.REPORT, "n": rnd, "w": what})
            _wait_for(lambda: FOLLOWER not in lead3.conns, "the hostile follower was kept")
            hands = _hands(lead3, good)
        else:
            hands = _hands(lead3, good)
            _wait_for(lambda: OTHER in lead3.pending.get(H.REPORT, {}), "no good hand read")
            H._send(hostile, {"k": H.REPORT, "n": rnd, "w": what})
        _the_others_go_on(lead3, hostile, good, hands)
    finally:
        hostile.close()
        good.close()
    assert f"dropped worker {FOLLOWER}, which sent round {rnd} of 'r'" in caplog.text


# -- a hostile leader: its follower must not wait on it past the deadline -------------------
class _Follower(_Host3):
    def __init__(self) -> None:
        super().__init__()
        self.info = self.nodes[FOLLOWER]


DROPS = {
    "half-a-frame": "part of a frame, not whole within 0.3 s",
    "no-answer": "what is no answer",
    "never-reads": "did not take a hand within 0.3 s",
    "silent": "did not take a hand within 0.3 s",
}


@pytest.mark.parametrize("answer", list(DROPS))
def test_a_stalled_or_broken_leader_is_dropped_and_the_follower_sends_its_own(
    monkeypatch, caplog, answer
):
    """A fake leader on the real socket takes the follower's report and answers half a frame
    (then nothing), or a frame that is no answer, or never reads the report (2.4 MB, more than
    the socket holds), or is silent (accepts, never reads a small report, never answers): the
    follower drops it, naming it, and sends its own report to the scheduler, every value its
    own; the scheduler's answer is its. A leader that did not read is not asked again."""
    monkeypatch.setattr(H, "_FRAME_S", 0.3)
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.settimeout(5.0)
    fake.bind(H._name(SECRET, 0, LEADER))
    fake.listen(1)
    node = _Follower()
    lead = H.HostLead(node)
    conn = None
    try:
        rows = 50_000 if answer == "never-reads" else 3
        mine = _report(1, 4, rows)
        got: list[Message] = []
        waits = threading.Thread(
            target=lambda: got.append(lead.report(1, mine).wait(5.0)), daemon=True
        )
        waits.start()  # (its hand to a leader that never reads waits in the thread)
        conn, _ = fake.accept()
        conn.settimeout(5.0)
        if answer != "silent":  # (silent: the hello and the hand stay unread)
            assert H._DECODERS[H.Hello].decode(_frame(conn)).id == FOLLOWER
        if answer not in ("never-reads", "silent"):
            hand = H._DECODERS[H.Hand].decode(_frame(conn))
            assert (hand.k, hand.n) == (H.REPORT, 1)
        if answer == "half-a-frame":
            conn.sendall(H._LEN.pack(1000) + bytes(10))  # 10 bytes of a 1,000-byte frame
        elif answer == "no-answer":
            conn.sendall(H._LEN.pack(3) + b"abc")
        _wait_for(lambda: node.sent, "the follower never sent its own report")
        (sent,) = node.sent
        assert sent is mine and sent.body == {"round": 1}
        for a, b in zip(sent.arrays, _report(1, 4, rows).arrays, strict=True):
            np.testing.assert_array_equal(a, b)
        plan = b"the packed plan"
        node.futures[0].set_result(
            Message(P.BALANCE_REPORT, reply=True, typed=H.BalanceAnswer(plan=plan))
        )
        waits.join(5.0)
        assert got and got[0].typed.plan == plan
        while conn.recv(1 << 20):  # (what it sent of a hand not taken)
            pass
        # the follower closed its connection (EOF)
        assert lead.up is None
        if answer in ("never-reads", "silent"):  # its next report goes directly, at once
            slot = lead.report(2, _report(2, 5)).slot
            assert slot.event.is_set() and slot.answer is None  # (not relayed: sent directly)
            assert not select.select([fake], [], [], 0)[0]  # (no new connection to the leader)
    finally:
        lead.close()
        for sock in (conn, fake):
            if sock is not None:
                sock.close()
    assert f"worker {FOLLOWER}: dropped host leader {LEADER}, which " in caplog.text
    assert DROPS[answer] in caplog.text


# -- rounds: a host's reports are pipelined (a worker waits for a round's answer one round
# later), so a worker may go on to its next round before another's report of the last one was
# read. The report it left waiting goes on its own then, not overwritten by the next: lost,
# the scheduler would never answer that round and every worker of the job would wait for it.


@pytest.mark.parametrize("ahead", ["leader", "follower"])
def test_a_report_left_waiting_when_its_worker_went_on_is_still_relayed(lead, ahead, caplog):
    node, sock = lead.node, _follower()
    _wait_for(lambda: FOLLOWER in lead.conns, "the follower was not accepted")
    # one worker reports rounds 1 and 2 before the other's report of round 1 is read
    mine = {rnd: _report(rnd, rnd) for rnd in (1, 2)}
    theirs = {rnd: _report(rnd, 10 + rnd) for rnd in (1, 2)}

    def leader_reports() -> None:
        lead.report(1, mine[1])
        lead.report(2, mine[2])

    def follower_reports() -> None:
        for rnd in (1, 2):
            _send_report(sock, rnd, theirs[rnd])
        _wait_for(lambda: lead.sent.get(H.REPORT, {}).get(FOLLOWER, 0) >= 1,
                  "the follower's round 1 was not relayed when it went on")  # fmt: skip

    for step in (leader_reports, follower_reports)[:: 1 if ahead == "leader" else -1]:
        step()
    got: dict[tuple[int, int], list[np.ndarray]] = {}

    def every_report() -> bool:
        for msg in list(node.sent):
            at = np.cumsum([0, *(s for s, _ in msg.body["host_rows"])])
            tt = np.cumsum([0, *(t for _, t in msg.body["host_rows"])])
            for j, nid in enumerate(msg.body["host"]):
                rows = [msg.arrays[0][at[j] : at[j + 1]], msg.arrays[1][tt[j] : tt[j + 1]]]
                got[(nid, msg.body["round"])] = rows
        return len(got) == 4

    try:
        _wait_for(every_report, "not every report of every round was relayed")
    finally:
        sock.close()
    assert sorted(got) == [(LEADER, 1), (LEADER, 2), (FOLLOWER, 1), (FOLLOWER, 2)]
    assert "dropped" not in caplog.text  # (a follower going on is no off-round one)
    for (nid, rnd), rows in got.items():  # every worker's report of every round, its values
        want = (mine if nid == LEADER else theirs)[rnd].arrays
        for a, b in zip(rows, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_follower_cannot_run_rounds_ahead_without_bound(lead, caplog):
    """A follower that goes on round after round while this worker reports none is kept
    AHEAD rounds past it (a synchronous job's workers are a round or two apart), then dropped,
    naming the round: the leader does not relay a stream of future rounds for it."""
    sock = _follower()
    try:
        _wait_for(lambda: FOLLOWER in lead.conns, "the follower was not accepted")
        for rnd in range(1, H.AHEAD + 2):  # (the last is refused: the leader closes)
            _send_report(sock, rnd, _report(rnd, rnd))
        _wait_for(lambda: FOLLOWER not in lead.conns, "a follower running ahead was kept")
    finally:
        sock.close()
    assert f"dropped worker {FOLLOWER}, which sent round {H.AHEAD + 1} of 'r'" in caplog.text
    # the rounds it had before: relayed on their own as it went on, the last one dropped
    assert [m.body["round"] for m in lead.node.sent] == list(range(1, H.AHEAD))


@pytest.fixture
def fake_leader():
    """A follower's node and a fake leader on the real socket (names of their own: another
    run's do not collide); closed after."""
    node = _Follower()
    node.cfg.secret = os.urandom(32)
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.settimeout(5.0)
    fake.bind(H._name(node.cfg.secret, 0, LEADER))
    fake.listen(1)
    yield node, fake
    fake.close()


def test_a_leader_that_reads_slowly_but_steadily_is_kept(fake_leader, monkeypatch, caplog):
    """A busy leader takes a 4.8 MB report in 64 KB reads 20 ms apart (1.5 s in all, three
    times the 0.5 s a hand may lie untaken) and then answers: the follower keeps it (the
    leader took part of it every time it looked) and takes its answer; nothing went directly."""
    monkeypatch.setattr(H, "_FRAME_S", 0.5)
    (node, fake), conn = fake_leader, None
    lead = H.HostLead(node)
    try:
        mine, got = _report(1, 4, 100_000), []
        waits = threading.Thread(target=lambda: got.append(lead.report(1, mine).wait(10.0)))
        waits.start()
        conn, _ = fake.accept()
        conn.settimeout(5.0)
        assert H._DECODERS[H.Hello].decode(_frame(conn)).id == FOLLOWER
        (size,) = H._LEN.unpack(conn.recv(H._LEN.size, socket.MSG_WAITALL))
        data = bytearray()
        while len(data) < size and (part := conn.recv(min(1 << 16, size - len(data)))):
            data += part
            time.sleep(0.02)  # (a busy leader: another thread's turn)
        assert len(data) == size, "the follower dropped its leader while it read the hand"
        hand = H._DECODERS[H.Hand].decode(bytes(data))
        assert (hand.k, hand.n, hand.w.s) == (H.REPORT, 1, mine.arrays[0].tobytes())
        _answer(conn, waits, got, 10.0)
        assert node.sent == [] and lead.up is not None and not lead.shunned
    finally:
        _close(lead, waits, conn, 10.0)
    assert "dropped host leader" not in caplog.text


def _answer(conn: socket.socket, waits: threading.Thread, got: list, timeout: float) -> None:
    """The fake leader answers the follower's report 1; the follower's waiter takes it."""
    H._send(conn, H.Told(H.REPORT, 1, True, H.BalanceAnswer(plan=b"the leader's plan")))
    waits.join(timeout)
    assert got and got[0].typed.plan == b"the leader's plan"


def _close(lead: H.HostLead, waits: threading.Thread, conn: socket.socket | None, t: float) -> None:
    lead.close()
    waits.join(t)
    if conn is not None:
        conn.close()


def test_a_follower_whose_socket_is_past_fd_1024_keeps_its_leader(fake_leader, caplog, monkeypatch):
    """A worker with many files open (a socket per server, shared memory, a data loader):
    its connection to the leader is a descriptor past 1024, which select() cannot watch.
    The leader reads the hand and answers: the follower takes the answer, drops nothing."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("fewer than 1,200 files may be open")
    (node, fake), conn = fake_leader, None

    class _Past1024:  # the host part's sockets made at descriptors past 1100
        def __getattr__(self, name: str) -> object:
            return getattr(socket, name)

        @staticmethod
        def socket(*args: object) -> socket.socket:
            with socket.socket(*args) as low:
                return socket.socket(fileno=fcntl.fcntl(low.fileno(), fcntl.F_DUPFD, 1100))

    monkeypatch.setattr(H, "socket", _Past1024())  # (descriptors freed meanwhile: not lower)
    lead = H.HostLead(node)
    try:
        mine, got = _report(1, 4), []
        waits = threading.Thread(target=lambda: got.append(lead.report(1, mine).wait(5.0)))
        waits.start()
        conn, _ = fake.accept()
        conn.settimeout(5.0)
        assert H._DECODERS[H.Hello].decode(_frame(conn)).id == FOLLOWER
        assert H._DECODERS[H.Hand].decode(_frame(conn)).n == 1
        assert lead.up is not None and lead.up.fileno() > 1024
        _answer(conn, waits, got, 5.0)
        assert node.sent == [] and lead.up is not None
    finally:
        _close(lead, waits, conn, 5.0)
    assert "dropped host leader" not in caplog.text
