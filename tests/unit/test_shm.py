"""Shared-memory rings between processes of one machine (transport/shm.py) and their use by
the codec and the van: wrap-around, a full ring, the offer handshake, bad descriptors, and
nothing left in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

from hetps.config import ConfigError, node_config_from_env
from hetps.transport import shm
from hetps.transport.codec import BadMessage, Message, decode, encode
from hetps.transport.codec import decode as codec_decode
from hetps.transport.shm import RING_MANY_BYTES
from hetps.transport.van import RING_MIN_BYTES, Van

MiB = 1 << 20


def _mine() -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"hetps-shm-{os.getpid()}-")]


@pytest.fixture
def ring_pair():
    out = shm.OutRing(4096)
    inn = shm.InRing(out.name)
    yield out, inn
    inn.close()
    out.close()
    assert not _mine()


def test_opening_unlinks_the_name_and_frames_come_back_exact(ring_pair):
    out, inn = ring_pair
    assert out.ready  # the receiver marked it open: the sender unlinks the name
    assert out.name not in os.listdir(shm.SHM_DIR)
    a = np.arange(100, dtype=np.uint8)
    pos = out.put(a)
    assert pos == 0
    got = inn.take(pos, a.nbytes)
    inn.commit()
    np.testing.assert_array_equal(got, a)
    a[:] = 7  # the copy taken out does not change with the sender's buffer
    assert got[5] == 5


def test_a_full_ring_refuses_until_the_receiver_consumed_and_frames_never_straddle(ring_pair):
    out, inn = ring_pair
    big = np.full(1500, 1, np.uint8)
    p1, p2 = out.put(big), out.put(big + 1)
    assert (p1, p2) == (0, 1536)  # 64-byte aligned spans
    assert out.put(big + 2) is None  # 3 x 1536 > 4096: full, the caller sends inline
    np.testing.assert_array_equal(inn.take(p1, 1500), big)
    inn.commit()
    p3 = out.put(big + 2)
    assert p3 == 4096  # 3072 + 1536 would pass the end: it starts the next lap
    np.testing.assert_array_equal(inn.take(p2, 1500), big + 1)
    np.testing.assert_array_equal(inn.take(p3, 1500), big + 2)
    inn.commit()
    with pytest.raises(ValueError, match="outside the ring's unread part"):
        inn.take(p2, 1500)  # consumed already: a replayed counter is refused
    assert out.put(np.zeros(5000, np.uint8)) is None  # larger than the ring: never fits


def test_the_receiver_refuses_bad_names_and_bad_positions(ring_pair):
    _, inn = ring_pair
    for name in ("../etc/passwd", "hetps-shm-1-zz", 5):
        with pytest.raises(ValueError, match="not a hetps ring name"):
            shm.InRing(name)
    with pytest.raises(FileNotFoundError):
        shm.InRing("hetps-shm-1-" + "0123456789abcdef" * 2)
    for pos, n in [(4000, 200), (1 << 40, 64), (8192, 10)]:  # past the end, or never written
        with pytest.raises(ValueError, match="outside the ring's unread part"):
            inn.take(pos, n)
    for pos in (-1, 1 << 63, 2**64 - 1, "7"):
        with pytest.raises(ValueError, match="bad ring position"):
            inn.take(pos, 10)


def test_rings_of_dead_creators_are_swept(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = f"hetps-shm-{proc.stdout.strip()}-0123456789abcdef"
    alive = f"hetps-shm-{os.getpid()}-0123456789abcdef"
    young = f"hetps-shm-{proc.stdout.strip()}-fedcba9876543210"
    old = time.time() - 2 * shm.STALE_AGE_S
    for name in (dead, alive, "unrelated", young):
        (tmp_path / name).write_bytes(b"x")
        if name != young:
            os.utime(tmp_path / name, (old, old))
    # the young one may be a live creator's in a PID namespace this process cannot see
    assert shm.sweep_stale(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted([alive, "unrelated", young])


def test_codec_carries_big_arrays_through_the_ring_and_small_ones_inline(ring_pair):
    out, inn = ring_pair
    out2 = shm.OutRing(MiB)
    in2 = shm.InRing(out2.name)
    try:
        big = np.arange(20000, dtype=np.float32)
        small = np.arange(3, dtype=np.int64)
        frames = encode(Message("push", arrays=[big, small]), out2, 1024)
        assert len(frames[1]) == 0 and len(frames[2]) == small.nbytes
        msg = decode(frames, 1 << 30, {in2.name: in2})
        np.testing.assert_array_equal(msg.arrays[0], big)
        np.testing.assert_array_equal(msg.arrays[1], small)
        assert in2.tail == 80000  # consumed: the sender may reuse the space
        # counters that are not in the unread part, however large, are refused cleanly
        for bad in (2**63, 2**64 - 1, 0):
            frames = encode(Message("push", arrays=[big]), out2, 1024)
            head = msgpack.unpackb(frames[0], raw=False)
            head["m"][1] = [bad]
            frames[0] = msgpack.packb(head, use_bin_type=True)
            with pytest.raises(BadMessage):
                decode(frames, 1 << 30, {in2.name: in2})
        assert in2.tail == 80000  # a refused message consumed nothing
        # a ring offered on one connection is not another connection's to use
        in2.owner = b"conn-3"
        frames = encode(Message("push", arrays=[big]), out2, 1024)
        with pytest.raises(BadMessage, match="other than the one that offered it"):
            decode(frames, 1 << 30, {in2.name: in2}, origin=b"conn-4")
        in2.owner = None
        with pytest.raises(BadMessage, match="never opened"):
            decode(encode(Message("push", arrays=[big]), out2, 1024), 1 << 30, {})
        frames = encode(Message("push", arrays=[big]), out2, 1024)
        frames[1] = b"xx"
        with pytest.raises(BadMessage, match="frame is not empty"):
            decode(frames, 1 << 30, {in2.name: in2})
        with pytest.raises(BadMessage, match="size bound"):
            decode(encode(Message("push", arrays=[big]), out2, 1024), 1000, {in2.name: in2})
    finally:
        in2.close()
        out2.close()


def test_van_moves_frames_through_the_ring_after_the_offer_and_inline_when_full():
    """Two vans on 127.0.0.1, real sockets: the first big message goes inline while the
    ring is offered; later ones go through the ring; with the receiver not reading, a full
    ring sends inline; every array arrives exact and in order; nothing stays in /dev/shm."""
    rx, tx = Van(name="rx", ring_bytes=8 * MiB), Van(name="tx", ring_bytes=8 * MiB)
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)  # rings are taken from known peers only
        n = RING_MIN_BYTES // 4 + 1024  # just above the bound, ~2 MiB each
        sent = [np.full(n, i, np.float32) for i in range(6)]
        tx.send(1, Message("push", arrays=[sent[0]]))
        first = rx.recv(timeout=10)
        assert first is not None and first.cmd == "push"  # the offer was consumed on the way
        ring = tx._rings_out[1]
        assert ring is not None and ring.ready and ring.head == 0
        for a in sent[1:]:  # nobody receives: three fit in 8 MiB, the rest go inline
            tx.send(1, Message("push", arrays=[a]))
        assert ring.head == 3 * 4 * n  # the three that fit (spans are 64-byte multiples)
        small = np.arange(1000, dtype=np.float32)  # below the bound: always inline
        tx.send(1, Message("push", arrays=[small]))
        assert ring.head == 3 * 4 * n
        got = [first] + [rx.recv(timeout=10) for _ in range(len(sent))]
        for a, m in zip([*sent, small], got, strict=True):
            np.testing.assert_array_equal(m.arrays[0], a)
        assert ring.free == ring.size  # all consumed
        tx.send(1, Message("push", arrays=[sent[3]]))
        np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], sent[3])
    finally:
        tx.close()
        rx.close()
    assert not _mine()


def test_a_full_ring_waits_for_the_receiver_to_free_room_before_going_inline():
    """A sender whose ring is full waits (a while) for the receiver to consume, instead of
    sending the array over the connection at once: the fourth 2 MiB array of an 8 MiB ring
    goes through the ring once the receiver has taken the first."""
    import threading

    rx, tx = Van(name="rx", ring_bytes=8 * MiB), Van(name="tx", ring_bytes=8 * MiB)
    tx.ring_wait_s = 60.0  # (long: the receiver below starts reading whenever it gets to)
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        n = RING_MIN_BYTES // 4 + 1024
        sent = [np.full(n, i, np.float32) for i in range(5)]
        tx.send(1, Message("push", arrays=[sent[0]]))  # inline: the ring is offered
        assert rx.recv(timeout=10) is not None
        ring = tx._rings_out[1]
        for a in sent[1:4]:
            tx.send(1, Message("push", arrays=[a]))
        assert ring.head == 3 * shm._span(4 * n) and not ring.fits([4 * n])  # full
        late = threading.Thread(target=tx.send, args=(1, Message("push", arrays=[sent[4]])))
        late.start()
        got = [rx.recv(timeout=10) for _ in range(4)]  # the first one read frees room
        late.join(30)
        assert not late.is_alive()
        # the fourth went through the ring too, at the start of its next lap
        assert ring.head == ring.size + shm._span(4 * n)
        for a, m in zip(sent[1:], got, strict=True):
            np.testing.assert_array_equal(m.arrays[0], a)
    finally:
        tx.close()
        rx.close()
    assert not _mine()


def test_many_small_arrays_that_reach_the_bound_together_go_through_the_ring():
    """A list call of many keys, each under the bound but together over RING_MANY_BYTES (a
    plain van's bound, 2 MiB, is higher), goes through the ring, not as one frame per key on
    the connection; fewer stay inline, tiny arrays count for nothing, and an array under the
    floor stays inline in a message that goes through the ring."""
    rx, tx = Van(name="rx", ring_bytes=8 * MiB), Van(name="tx", ring_bytes=8 * MiB)
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        n = 10_000  # 40 KB each: alone, far under the bound
        count = RING_MANY_BYTES // (4 * n) + 1
        tiny = np.arange(16, dtype=np.float32)  # under the floor
        many = [np.full(n, i, np.float32) for i in range(count)] + [tiny]
        tx.send(1, Message("push", arrays=[np.zeros(RING_MIN_BYTES // 4, np.float32)]))
        assert rx.recv(timeout=10) is not None  # inline while the ring is offered
        ring = tx._rings_out[1]
        assert ring is not None and ring.ready and ring.head == 0
        few = [np.full(n, 7, np.float32) for _ in range(count - 1)]
        few += [np.arange(1000, dtype=np.float32)] * 20  # 4000 B each: under the floor
        tx.send(1, Message("push", arrays=few))
        assert ring.head == 0  # under RING_MANY_BYTES without the tiny ones: inline
        tx.send(1, Message("push", arrays=many))
        assert ring.head == count * shm._span(4 * n)  # every 40 KB array; the tiny one inline
        got_few, got_many = rx.recv(timeout=10), rx.recv(timeout=10)
        for a, b in zip(few, got_few.arrays, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(many, got_many.arrays, strict=True):
            np.testing.assert_array_equal(a, b)
        assert ring.free == ring.size  # all consumed
    finally:
        tx.close()
        rx.close()
    assert not _mine()


def test_every_answer_of_a_batch_lands_in_its_own_requests_destination():
    """A batch of answers lands each answer's first array where its request named; the node
    names places only for requests sent to the answering peer, and none for a body that does
    not read as a batch."""
    from types import SimpleNamespace

    from hetps.cluster import protocol as P
    from hetps.cluster.node import Node
    from hetps.cluster.requests import RequestTracker

    tracker = RequestTracker()
    dest = [np.zeros(1000, np.float32) for _ in range(3)]
    futs = [tracker.new(peer=9, what="pull") for _ in range(3)]
    for f, d in zip(futs, dest, strict=True):
        f.landing = d
    other = tracker.new(peer=8, what="pull")  # sent to another server
    other.landing = np.zeros(1000, np.float32)
    node = SimpleNamespace(requests=tracker)
    items = [
        [P.PULL, futs[0].req, {}, 1],
        [P.PUSH, futs[1].req, {}, 0],  # an answer without arrays
        [P.PULL, futs[2].req, {}, 2],
        [P.PULL, other.req, {}, 1],
    ]
    places = Node._landings(node, 9, P.BATCH, 1, {"items": items}, 4)
    assert set(places) == {0, 1} and places[0] is dest[0] and places[1] is dest[2]
    assert Node._landings(node, 8, P.BATCH, 1, {"items": items}, 4) == {3: other.landing}
    # all or nothing: a batch the node would refuse lands nothing, not its first items
    for body, count in (
        ({"items": "x"}, 4),
        ({"items": [[P.PULL, "r", {}, 1]]}, 1),
        ({"items": items + [["bad"]]}, 4),  # junk after good items
        ({"items": items}, 5),  # counts that do not add up to the arrays
        ({"items": items, "error": "refused"}, 4),
        ({"items": items[:1] * (P.MAX_BATCH_ITEMS + 1)}, P.MAX_BATCH_ITEMS + 1),
    ):
        assert Node._landings(node, 9, P.BATCH, 1, body, count) is None, body
    assert Node._landings(node, 9, P.PULL, futs[2].req, {}, 1)[0] is dest[2]
    assert Node._landings(node, 8, P.PULL, futs[2].req, {}, 1) is None
    assert Node._landings(node, 9, P.PULL, futs[2].req, {"error": "no"}, 1) is None

    out = shm.OutRing(1 << 20)
    inn = shm.InRing(out.name)
    inn.owner = b"conn"
    try:
        vals = [np.full(1000, i + 1, np.float32) for i in range(4)]
        frames = encode(Message(P.BATCH, req=1, reply=True, arrays=vals), out, 64)
        got = codec_decode(
            frames, 1 << 30, {out.name: inn}, lambda c, r, b, n: places, origin=b"conn"
        )
        assert got.arrays[0].ctypes.data == dest[0].ctypes.data
        assert got.arrays[1].ctypes.data == dest[2].ctypes.data
        assert not any(np.shares_memory(got.arrays[i], d) for i in (2, 3) for d in dest)
        for a, v in zip(got.arrays, vals, strict=True):
            np.testing.assert_array_equal(a, v)
    finally:
        inn.close()
        out.close()


def test_a_caller_that_gives_up_gets_its_error_only_after_the_answer_stopped_landing():
    """The receive thread looked up a request's place and is still copying into it when the
    caller's wait times out: the caller gets its RequestTimeout only once the copy is over, so
    it never reuses its array while the answer is being written there."""
    import threading

    from hetps.cluster.errors import RequestTimeout
    from hetps.cluster.requests import RequestTracker

    tracker = RequestTracker()
    fut = tracker.new(peer=9, what="pull")
    fut.landing = np.zeros(10, np.float32)
    writing = {"over": False}
    seen: list = []

    def caller() -> None:
        try:
            fut.wait(0.01)
        except RequestTimeout:
            seen.append(writing["over"])

    tracker.landing_guard.acquire()  # the receive thread is decoding into fut.landing
    t = threading.Thread(target=caller)
    t.start()
    from hetps.cluster.requests import _block

    _block(fut._gate, 10)  # the caller gave up
    t.join(1.0)  # it must still be waiting for the copy to end
    writing["over"] = True
    tracker.landing_guard.release()
    t.join(10)
    assert seen == [True]


def test_a_peer_on_another_address_never_gets_a_ring():
    v = Van(name="v", ring_bytes=MiB)
    try:
        v.connect(1, "10.255.255.1:5")  # not this machine: frames stay on TCP
        v.connect(2, "127.0.0.1:5")
        assert 1 not in v._local and 2 in v._local
    finally:
        v.close()


def test_shm_bytes_is_validated():
    base = {
        "DMLC_ROLE": "worker",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "1",
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "1",
    }
    assert node_config_from_env({**base, "HETPS_SHM_BYTES": "0"}).shm_bytes == 0
    with pytest.raises(ConfigError, match="HETPS_SHM_BYTES=1000 is too small"):
        node_config_from_env({**base, "HETPS_SHM_BYTES": "1000"})


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_ring_that_does_not_fit_in_shared_memory_is_refused_not_a_crash(tmp_path):
    """A sparse ring on a nearly full /dev/shm (Docker's default is 64 MB) would raise
    SIGBUS at the first write that finds no page; the ring allocates its pages up front, so
    it fails with OSError (the van then sends over TCP) and leaves no file behind."""
    small = tmp_path / "shm"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(OSError):
            shm.OutRing(4 * MiB, directory=str(small))
        assert os.listdir(small) == []
        ring = shm.OutRing(256 * 1024, directory=str(small))  # this one fits
        ring.close()
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_ring_the_peer_never_opens_is_given_back_and_a_reconnect_offers_anew(monkeypatch):
    """A receiver that cannot map the ring (another container behind the same address) keeps
    getting TCP; after a few big sends the sender frees the ring's memory. A reconnect to
    the peer (perhaps a new process) drops the old ring."""
    from hetps.transport import van as van_mod

    monkeypatch.setattr(van_mod, "RING_GIVE_UP_SENDS", 3)
    rx, tx = Van(name="rx", ring_bytes=8 * MiB), Van(name="tx", ring_bytes=8 * MiB)
    monkeypatch.setattr(rx, "_open_ring", lambda msg: None)  # it cannot open rings
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        a = np.arange(RING_MIN_BYTES // 4 + 16, dtype=np.float32)
        for i in range(5):
            tx.send(1, Message("push", arrays=[a + i]))
            np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], a + i)
            if i == 1:
                assert _mine()  # offered, not opened: the name is still there
        assert tx._rings_out[1] is None and not _mine()  # given back, TCP from now on
        monkeypatch.undo()
        rx.admit(tx.connect(1, rx.endpoint), 5)  # a new connection: a new ring may be offered
        assert 1 not in tx._rings_out
        tx.send(1, Message("push", arrays=[a]))
        np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], a)
        tx.send(1, Message("push", arrays=[a]))
        np.testing.assert_array_equal(rx.recv(timeout=10).arrays[0], a)
        assert tx._rings_out[1] is not None and tx._rings_out[1].head > 0
    finally:
        tx.close()
        rx.close()
    assert not _mine()


def test_a_reply_lands_straight_in_its_requests_destination():
    """decode copies a ring-borne reply array into the place its request named (one copy
    less for every big pull); a place of the wrong dtype, size or layout, a request nobody
    waits for, or a message that is not a reply gets a new array as before."""
    out = shm.OutRing(1 << 16)
    inn = shm.InRing(out.name)
    rings = {out.name: inn}
    try:
        vals = np.arange(1000, dtype=np.float32)
        dest = np.zeros(1000, np.float32)
        places = {7: dest}

        def frames(req: int, reply: bool = True) -> list:
            msg = Message("push", req=req, reply=reply, arrays=[vals])
            return encode(msg, out, 64)

        inn.owner = b"conn-3"

        def decode(frames, bound, rings, get):  # noqa: F811 - on connection conn-3
            def landing(cmd, req, body, count):
                target = get(req)
                return None if target is None else {0: target}

            return codec_decode(frames, bound, rings, landing, origin=b"conn-3")

        got = decode(frames(7), 1 << 30, rings, places.get)
        assert got.arrays[0].ctypes.data == dest.ctypes.data
        np.testing.assert_array_equal(dest, vals)
        for other in (
            np.zeros(1000, np.float64),
            np.zeros(999, np.float32),
            np.zeros((2000,), np.float32)[::2],
        ):
            places[8] = other
            got = decode(frames(8), 1 << 30, rings, places.get)
            assert not np.shares_memory(got.arrays[0], other)
            np.testing.assert_array_equal(got.arrays[0], vals)
        dest[:] = 0
        for req, reply in ((9, True), (7, False)):  # nobody waits for 9; 7 is not a reply
            got = decode(frames(req, reply), 1 << 30, rings, places.get)
            assert not np.shares_memory(got.arrays[0], dest)
        assert not dest.any()
    finally:
        inn.close()
        out.close()


@pytest.mark.parametrize("secret", [None, b"s" * 64], ids=["plain", "secured"])
def test_mid_size_arrays_take_the_ring_only_when_the_connection_is_encrypted(secret):
    """With a cluster secret every frame on the connection is encrypted, so arrays from
    4 KiB go through the ring (after the offer, the first goes inline); without one, only
    arrays of 2 MiB or more do. Every array arrives exact either way."""
    rx = Van(name="rx", ring_bytes=8 * MiB, secret=secret)
    tx = Van(name="tx", ring_bytes=8 * MiB, secret=secret)
    try:
        rx.admit(tx.connect(1, rx.endpoint), 5)
        sent = [np.full(4 << 10, i, np.float32) for i in range(4)]  # 16 KiB each
        tx.send(1, Message("push", arrays=[sent[0]]))
        got = [rx.recv(timeout=10)]  # the offer (if any) is taken on the way
        for a in sent[1:]:
            tx.send(1, Message("push", arrays=[a]))
        got += [rx.recv(timeout=10) for _ in sent[1:]]
        for a, m in zip(sent, got, strict=True):
            np.testing.assert_array_equal(m.arrays[0], a)
        ring = tx._rings_out.get(1)
        if secret is None:
            assert ring is None  # never offered: below the plain bound
        else:
            assert ring is not None and ring.ready and ring.head == 3 * sent[0].nbytes
    finally:
        tx.close()
        rx.close()
    assert not _mine()
