"""Codec: round trips, zero-copy decode, and refusal of every malformed field."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from hetps.transport.codec import VERSION, BadMessage, Message, decode, encode


def _frames(msg: Message) -> list[bytes]:
    return [bytes(f) if not isinstance(f, bytes) else f for f in encode(msg)]


def test_round_trip_all_dtypes():
    arrays = [
        np.arange(6, dtype=dt).reshape(2, 3)
        for dt in ("float16", "float32", "float64", "uint8", "uint32", "int32", "int64")
    ]
    msg = Message("push", sender=9, req=42, priority=-3, body={"k": "w", "n": 6}, arrays=arrays)
    out = decode(_frames(msg), 1 << 20)
    assert (out.cmd, out.req, out.priority, out.reply) == ("push", 42, -3, False)
    # the sender is not on the wire: the receiving van names it from the connection
    assert out.sender == 0 and b"\xa1s" not in _frames(msg)[0]
    assert out.body == {"k": "w", "n": 6}
    for a, b in zip(arrays, out.arrays, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    assert out.nbytes == msg.nbytes


def test_decode_does_not_copy_payload():
    payload = bytearray(np.arange(4, dtype=np.float32).tobytes())
    header = encode(Message("push", arrays=[np.zeros(4, np.float32)]))[0]
    out = decode([header, payload], 1 << 20)
    payload[0:4] = np.float32(7).tobytes()
    assert out.arrays[0][0] == 7  # a view over the received buffer


def test_non_contiguous_and_empty_arrays():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    out = decode(_frames(Message("x", arrays=[a, np.zeros((0, 5), np.float32)])), 1 << 20)
    assert (out.arrays[0] == a).all() and out.arrays[1].shape == (0, 5)


def test_unsupported_dtype_is_refused_on_send():
    with pytest.raises(ValueError, match="cannot be sent"):
        encode(Message("x", arrays=[np.zeros(2, np.complex64)]))


def _header(**over) -> bytes:
    h = {
        "v": VERSION,
        "c": "push",
        "s": 9,
        "r": 1,
        "p": False,
        "o": 0,
        "t": 0.0,
        "b": {},
        "a": [["float32", [4]]],
    }
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize(
    "frames,match",
    [
        ([], "empty"),
        ([b"\xc1garbage"], "not msgpack"),
        ([msgpack.packb([1, 2])], "not a map"),
        ([_header(v=99), bytes(16)], "version"),
        ([_header(c=""), bytes(16)], "command"),
        ([_header(r="nine"), bytes(16)], "'r'"),
        ([_header(p=1), bytes(16)], "'p'"),
        ([_header(b=[1]), bytes(16)], "body"),
        ([_header(), bytes(16), bytes(4)], "announces 1 arrays in 1 frames but 2"),
        ([_header(), bytes(15)], "needs 16"),
        ([_header(a=[["complex64", [4]]]), bytes(32)], "not allowed"),
        ([_header(a=[["float32", [-4]]]), bytes(16)], "non-negative"),
        ([_header(a=[["float32"]]), bytes(16)], "dtype, shape"),
        ([_header(a=[["float32", [1 << 20]]]), bytes(1 << 22)], "size bound"),
    ],
)
def test_malformed_messages_raise_bad_message(frames, match):
    with pytest.raises(BadMessage, match=match):
        decode(frames, 1 << 21)


def test_van_flags_a_message_that_waited_for_the_receive_thread():
    """``Message.backlogged``: the message was already queued when the receive thread came
    to look, so the time it is taken is later than its arrival (a late forecast stamp would
    make a probe read too fast)."""
    from hetps.transport.van import Van

    srv, cli = Van(name="srv"), Van(name="cli")
    try:
        cli.connect(1, srv.endpoint)
        cli.send(1, Message("forecast", body={"tag": 1}))
        assert srv._router.poll(5000)  # it has arrived, and nobody took it yet
        msg = srv.recv(timeout=5)
        assert msg is not None and msg.cmd == "forecast" and msg.backlogged
    finally:
        cli.close()
        srv.close()
