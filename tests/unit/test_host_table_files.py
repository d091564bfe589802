"""A host table's published files in /dev/shm (kvstore/hostagg_tables.py): a file left at
an event's name (a crashed run of the same job, secret and scheduler address) is replaced
by the event's own, never read in its place; a planted link is refused."""

from __future__ import annotations

import os
import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from hetps.cluster.errors import ClusterError
from hetps.kvstore.hostagg_tables import HostTable, HostTables
from hetps.kvstore.hostshm import SHM_DIR, unlink

COLS = 4


@pytest.fixture
def files():
    agg = SimpleNamespace(group=0, job=secrets.token_hex(32), gens={})
    tables = HostTables(agg)
    tm = SimpleNamespace(
        table=SimpleNamespace(cols=COLS, rows=100), dtype=np.dtype("float32"), nparts=1
    )
    ht = HostTable("t", None, tm)
    names: list[str] = []

    def name(kind: str, e: int, who: int) -> str:
        names.append(tables._name(ht, kind, e, who))
        return names[-1]

    yield tables, ht, name
    for n in names:
        unlink(n)


def test_a_stale_file_at_an_events_name_is_replaced(files):
    tables, ht, name = files
    path = name("push", 1, 0)
    old_ids, old_rows = np.arange(5, dtype=np.int64), np.full((5, COLS), 9.0, np.float32)
    tables._write(ht, path, 1, old_ids, old_rows)  # (as the crashed run left it)
    ids = np.array([3, 17, 42], np.int64)
    rows = np.random.default_rng(0).standard_normal((3, COLS)).astype(np.float32)
    tables._write(ht, path, 1, ids, rows)
    got_ids, got_rows = tables._read(ht, path)
    np.testing.assert_array_equal(got_ids, ids)
    assert got_rows.tobytes() == rows.tobytes()
    assert os.stat(os.path.join(SHM_DIR, path)).st_mode & 0o777 == 0o600


def test_a_link_planted_at_an_events_name_is_neither_followed_nor_read(files, tmp_path):
    tables, ht, name = files
    path, theirs = name("push", 2, 1), name("rows", 2, 0)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * 4096)
    for n in (path, theirs):
        os.symlink(target, os.path.join(SHM_DIR, n))
    ids, rows = np.array([7], np.int64), np.ones((1, COLS), np.float32)
    tables._write(ht, path, 2, ids, rows)  # the link is replaced by the event's own file
    got_ids, got_rows = tables._read(ht, path)
    assert got_ids.tolist() == [7] and got_rows.tobytes() == rows.tobytes()
    with pytest.raises(ClusterError, match="is not a private file: refused"):
        tables._read(ht, theirs)  # another rank's name a link: refused, naming the file
    assert target.read_bytes() == b"\0" * 4096  # (nothing written through)
