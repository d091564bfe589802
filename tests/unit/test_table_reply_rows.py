"""A pull's reply on its data path: the server gathers the rows straight into the shared-memory
ring's slot (``codec.Rows``), the worker copies them out of the ring straight into the pull's
rows (``tables.worker._Landing``), and a table that changes before its reply left does not
change what the reply holds."""

from __future__ import annotations

import numpy as np
import pytest

from hetps import optim
from hetps.cluster.errors import ClusterError
from hetps.tables.server_shard import Shard, apply_rows
from hetps.tables.worker import land_rows
from hetps.transport import shm
from hetps.transport.codec import Message, Rows, decode, encode

COLS = 32


@pytest.fixture
def rings():
    out = shm.OutRing(1 << 20)
    inn = shm.InRing(out.name)
    try:
        yield out, inn
    finally:
        inn.close()
        out.close()


def _decode(frames, inn, landing):
    return decode(frames, 1 << 30, {inn.name: inn}, lambda *a: {0: landing}, origin=b"c")


def test_reply_rows_go_into_the_ring_slot_and_out_of_it_into_the_pulls_rows(rings):
    out, inn = rings
    inn.owner = b"c"
    table = np.random.default_rng(0).standard_normal((500, COLS)).astype(np.float32)
    loc = np.array([7, 3, 499, 0, 250, 251], np.int64)
    gathered: list = []
    msg = Message("spull", req=9, reply=True, arrays=[Rows(table, loc, gathered.append)])
    frames = encode(msg, out, 64)
    assert len(gathered) == 1 and len(frames[1]) == 0  # into the ring, none on the wire
    assert msg.arrays[0]._got is None  # straight into its slot: no array of its own first
    dest = np.full((10, COLS), -1, np.float32)
    sel = np.array([9, 0, 4, 2, 6, 1], np.int64)  # where each reply row goes
    land = land_rows("t", dest, sel, COLS)
    reply = _decode(frames, inn, land)
    assert reply.arrays[0] is land.mark  # (copied out of the ring already)
    land(reply)
    assert reply.arrays == []
    np.testing.assert_array_equal(dest[sel], table[loc])
    untouched = np.setdiff1d(np.arange(10), sel)
    assert (dest[untouched] == -1).all()


def test_reply_rows_without_a_ring_are_one_array_and_land_when_handled(rings):
    _, inn = rings
    table = np.arange(40 * COLS, dtype=np.float32).reshape(40, COLS)
    loc = np.array([39, 1, 20], np.int64)
    gathered: list = []
    frames = encode(Message("spull", req=3, reply=True, arrays=[Rows(table, loc, gathered.append)]))
    assert len(gathered) == 1 and len(frames[1]) == 3 * COLS * 4
    dest = np.zeros((3, COLS), np.float32)
    land = land_rows("t", dest, np.arange(3), COLS)
    reply = _decode(frames, inn, land)
    land(reply)
    np.testing.assert_array_equal(dest, table[loc])


def test_a_reply_of_the_wrong_size_is_refused_not_landed(rings):
    out, inn = rings
    inn.owner = b"c"
    table = np.ones((50, COLS), np.float32)
    frames = encode(
        Message("spull", req=4, reply=True, arrays=[Rows(table, np.arange(5))]), out, 64
    )
    dest = np.zeros((8, COLS), np.float32)
    land = land_rows("t", dest, np.arange(4), COLS)  # four rows asked, five came
    reply = _decode(frames, inn, land)
    with pytest.raises(ClusterError, match="wrong-sized reply"):
        land(reply)
    assert not dest.any()


def test_a_table_that_changes_before_the_reply_left_keeps_the_replys_rows(rings):
    out, inn = rings
    inn.owner = b"c"
    decl = {"rows": 64, "cols": COLS, "dtype": "float32", "scale": 0.5, "seed": 1, "bound": 0}
    sh = Shard("t", decl, 0, 2)
    ids = np.array([0, 2, 10, 62], np.int64)
    before = sh.read(ids).copy()
    rows = sh.reply_rows(ids)  # (gathered as it leaves: not yet)
    with pytest.raises(ValueError):
        sh.value[0] = 0  # a write that does not settle first fails loudly
    grad = np.ones((ids.size, COLS), np.float32)
    apply_rows(sh, optim.SGD(learning_rate=0.5), ids, grad)  # the next round, before sending
    np.testing.assert_array_equal(sh.read(ids), before - 0.5)
    frames = encode(Message("spull", req=5, reply=True, arrays=[rows]), out, 64)
    got = decode(frames, 1 << 30, {inn.name: inn}, origin=b"c").arrays[0]
    np.testing.assert_array_equal(got.reshape(-1, COLS), before)
    assert sh.lent == [] and sh.value.flags.writeable
