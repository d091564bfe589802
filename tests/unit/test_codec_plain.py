"""The codec's quick paths: the quick decode takes only what the full decode takes, and
gives the same message; headers pack as before from any thread."""

from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest

from hetps.transport import shm
from hetps.transport.codec import (
    VERSION,
    BadMessage,
    Message,
    _decode_plain,
    decode,
    encode,
)

MAX = 1 << 21


def _same(a: Message, b: Message) -> None:
    assert (a.cmd, a.req, a.reply, a.priority, a.body, a.sent_at, a.nbytes) == (
        b.cmd,
        b.req,
        b.reply,
        b.priority,
        b.body,
        b.sent_at,
        b.nbytes,
    )
    assert len(a.arrays) == len(b.arrays)
    for x, y in zip(a.arrays, b.arrays, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


VALID = [
    Message("push", req=7, body={"k": "w", "n": 3}, arrays=[np.arange(3, dtype=np.float32)]),
    Message("pull", req=1, reply=True, priority=-4, body={"b": b"\x00\x01"}),
    Message("init", req=2, arrays=[np.ones((2, 3, 4), np.float64), np.arange(5, dtype=np.int64)]),
    Message("push", req=3, arrays=[np.ones((1, 1), np.float16), np.zeros(7, np.uint8)]),
    Message("x", req=0, arrays=[np.zeros(0, np.float32)]),  # empty: the full decode's
    Message("batch", req=9, body={"items": [["push", 9, {}, 1]]}, arrays=[np.ones(2, np.int32)]),
]


@pytest.mark.parametrize("msg", VALID, ids=[m.cmd for m in VALID])
def test_the_quick_decode_agrees_with_the_checked_one(msg):
    frames = encode(msg)
    _same(decode(frames, MAX), decode(frames, MAX, quick=False))
    quick = _decode_plain(frames, MAX)
    if all(a.size for a in msg.arrays):
        assert quick is not None  # the common message takes the quick path
        _same(quick, decode(frames, MAX, quick=False))


def test_a_ring_borne_message_takes_the_quick_path_and_decodes_as_the_checked_one():
    """Arrays in a shared-memory ring (and one inline beside them): a request's are lent by
    both decodes alike (nothing released, so both read the same slots); a reply's land in
    the caller's array by both, the same values."""
    out, inn = shm.OutRing(1 << 20), None
    try:
        inn = shm.InRing(out.name)
        rings = {out.name: inn}
        rows = np.arange(2048, dtype=np.float32).reshape(128, 16)
        ids = np.arange(100, dtype=np.int64)  # 800 bytes: inline
        frames = encode(Message("spush", req=4, body={"k": 1}, arrays=[ids, rows]), out, 4096)
        assert frames[2] == b"" and len(frames[1]) == ids.nbytes  # (the rows in the ring)
        quick = _decode_plain(frames, MAX, rings, None, None, {"spush"})
        assert quick is not None and quick.lease is inn
        full = decode(frames, MAX, rings, None, None, {"spush"}, quick=False)
        _same(quick, full)
        np.testing.assert_array_equal(quick.arrays[1], rows)
        inn.commit()
        landed = []
        for fast in (True, False):
            target = np.zeros(rows.size, np.float32)
            reply = Message("spull", req=5, reply=True, arrays=[rows])
            frames = encode(reply, out, 4096)
            got = decode(frames, MAX, rings, lambda *a, t=target: {0: t}, None, (), quick=fast)
            assert got.lease is None and inn.tail == inn._taken  # (released)
            assert got.arrays[0].base is target or got.arrays[0] is target
            landed.append((got, target))
        (a, ta), (b, tb) = landed  # (encoded twice: the send times differ)
        assert (a.cmd, a.req, a.reply, a.body, a.nbytes) == (
            b.cmd,
            b.req,
            b.reply,
            b.body,
            b.nbytes,
        )
        np.testing.assert_array_equal(ta, rows.reshape(-1))
        np.testing.assert_array_equal(tb, rows.reshape(-1))
    finally:
        if inn is not None:
            inn.close()
        out.close()


def _header(**over) -> bytes:
    h = {"v": VERSION, "c": "push", "r": 1, "p": False, "o": 0, "t": 0.0, "b": {}}
    h["a"] = [["float32", [4]]]
    h.update(over)
    return msgpack.packb(h, use_bin_type=True)


BAD = [
    [_header(r=True), bytes(16)],
    [_header(o=False), bytes(16)],
    [_header(o=1.5), bytes(16)],
    [_header(p=1), bytes(16)],
    [_header(t=True), bytes(16)],
    [_header(t="now"), bytes(16)],
    [_header(c="pu\nsh"), bytes(16)],
    [_header(c="p" * 65), bytes(16)],
    [_header(c=7), bytes(16)],
    [_header(b=[1]), bytes(16)],
    [_header(v=2), bytes(16)],
    [_header(a=[["float32", [True, 4]]]), bytes(16)],
    [_header(a=[["float32", [-4]]]), bytes(16)],
    [_header(a=[[1, [4]]]), bytes(16)],
    [_header(a=[["float32", 4]]), bytes(16)],
    [_header(a=[["float32", [4], 0]]), bytes(16)],
    [_header(a=[["float32", [1] * 33]]), bytes(4)],
    [_header(a=("float32", [4])), bytes(16)],
    [_header(), bytes(15)],
    [_header(), bytes(17)],
    [_header(), bytes(16), bytes(16)],
    [_header()],
    [_header(a=[["float32", [1 << 19]]]), bytes(1 << 21)],  # over MAX with its header
    [_header(m=["ring", [0]]), b""],
    [msgpack.packb([1, 2]), bytes(16)],
    [b"\xc1", bytes(16)],
]


@pytest.mark.parametrize("frames", BAD, ids=range(len(BAD)))
def test_the_quick_decode_takes_nothing_the_checked_one_refuses(frames):
    assert _decode_plain(frames, MAX) is None
    with pytest.raises(BadMessage):
        decode(frames, MAX)


def test_headers_pack_as_before_from_any_thread():
    """A packer per thread: bytes stay bytes (bin type) and every header reads back."""
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(300):
                msg = Message("push", req=j + 1, body={"k": f"{i}-{j}", "raw": bytes([i, j % 256])})
                head = msgpack.unpackb(encode(msg)[0], raw=False)
                assert head["b"] == {"k": f"{i}-{j}", "raw": bytes([i, j % 256])}
                assert head["r"] == j + 1 and head["c"] == "push"
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
