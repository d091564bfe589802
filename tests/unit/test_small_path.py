"""The small-message path's shortcuts: the van reads a message frame by frame, a dtype's
name is looked up, a pulled value is copied unless it landed in place."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.transport.codec import FRAME_MAX, Message, dtype_str
from hetps.transport.van import Van


def test_the_van_takes_every_frame_of_a_message_and_no_more():
    """Frames are read while the last one says more follow: messages of no, one, several
    arrays and an array split over frames arrive whole, one by one."""
    srv, cli = Van(name="srv"), Van(name="cli")
    big = np.arange(FRAME_MAX // 4 + 3, dtype=np.float32)  # two frames on the wire
    sent = [
        Message("a"),
        Message("b", arrays=[np.arange(3, dtype=np.int32)]),
        Message("c", arrays=[np.ones(2, np.float64), np.zeros((2, 2), np.uint8), np.ones(1)]),
        Message("d", arrays=[big]),
        Message("e", req=5, body={"x": 1}),
    ]
    try:
        cli.connect(1, srv.endpoint)
        for m in sent:
            cli.send(1, m)
        for m in sent:
            got = srv.recv(timeout=10)
            assert got is not None and got.cmd == m.cmd and got.body == m.body
            assert len(got.arrays) == len(m.arrays)
            for x, y in zip(got.arrays, m.arrays, strict=True):
                np.testing.assert_array_equal(x, y)
        assert srv.recv(timeout=0.2) is None
    finally:
        cli.close()
        srv.close()


@pytest.mark.parametrize("dt", ["float16", "<f4", ">f4", "float64", "u1", "<u4", "i4", "<i8", "c8"])
def test_a_dtypes_name_is_numpys(dt):
    dtype = np.dtype(dt)
    assert dtype_str(dtype) == dtype.name
    assert dtype_str(dtype) == dtype.name  # (the second time from the table)


def test_a_pulled_value_is_copied_unless_it_landed_in_place():
    from hetps.kvstore.keys import land_into

    dest = np.zeros(8, np.float32)
    land = land_into("k", dest, 2, 5)
    # a reply in its own buffer: copied
    reply = Message("pull", reply=True, arrays=[np.array([1, 2, 3], np.float32)])
    land(reply)
    assert dest.tolist() == [0, 0, 1, 2, 3, 0, 0, 0] and reply.arrays == []
    # in dest but not at [2, 5) (it shares memory, yet is elsewhere): copied too
    dest[:] = [9, 8, 7, 6, 5, 4, 3, 2]
    land(Message("pull", reply=True, arrays=[dest[4:7]]))
    assert dest.tolist() == [9, 8, 5, 4, 3, 4, 3, 2]
    # already at [2, 5) (the van wrote it there from a ring): left as it is
    fixed = np.arange(8, dtype=np.float32)
    fixed.flags.writeable = False  # a copy onto it would raise
    land_into("k", fixed, 2, 5)(Message("pull", reply=True, arrays=[fixed[2:5]]))
    assert fixed.tolist() == list(range(8))
