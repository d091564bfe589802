"""The vectorised row paths of the tables (hetps.tables.lazy, hetps.tables.rowsparse): distinct
ids by a sort, rows gathered and written, MXNet's lazy_update=False block by block, and the
search for a non-finite row, each against the plain NumPy it replaces."""

from __future__ import annotations

import numpy as np
import pytest

from hetps import optim
from hetps.tables import lazy
from hetps.tables.rowsparse import first_nonfinite


@pytest.mark.parametrize("n", [0, 1, 2, 7, 5000])
def test_distinct_and_its_inverse_are_np_unique(n):
    rng = np.random.default_rng(n)
    ids = rng.integers(0, max(1, n // 2), n).astype(np.int64)  # repeats, unsorted
    uniq, inv = np.unique(ids, return_inverse=True)
    assert np.array_equal(lazy.distinct(ids), uniq)
    got, got_inv = lazy.distinct_inverse(ids)
    assert np.array_equal(got, uniq)
    assert np.array_equal(got[got_inv] if got_inv is not None else got, ids)
    already = np.unique(ids)  # sorted distinct: returned as is, no inverse
    same, none = lazy.distinct_inverse(already)
    assert same is already and none is None and lazy.distinct(already) is already


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_take_and_put_rows_are_fancy_indexing(dtype):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, 5)).astype(dtype)
    rows = rng.choice(50, 12, replace=False)
    assert np.array_equal(lazy.take_rows(table, rows), table[rows])
    vals = rng.standard_normal((12, 5)).astype(np.float32)  # (cast as assignment casts)
    expect = table.copy()
    expect[rows] = vals
    lazy.put_rows(table, rows, vals)
    assert np.array_equal(table, expect)
    view = np.zeros((50, 10), dtype)[:, ::2]  # not contiguous: fancy assignment
    lazy.put_rows(view, rows, vals)
    assert np.array_equal(view[rows], vals.astype(dtype))


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad"])
def test_every_row_block_by_block_is_the_dense_rule(name, monkeypatch):
    """lazy_update=False over several blocks (the step counted once per round) equals the
    dense optimizer on the whole table with zeros on the untouched rows."""
    monkeypatch.setattr(lazy, "EVERY_ROW_BLOCK", 7)
    make = {
        "sgd": lambda: optim.SGD(learning_rate=0.1, momentum=0.9, wd=0.01),
        "adam": lambda: optim.Adam(learning_rate=0.01, wd=0.01),
        "adagrad": lambda: optim.AdaGrad(learning_rate=0.1),
    }[name]
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal((30, 4)).astype(np.float32)
    sparse, dense = w0.copy(), w0.copy()
    opt, ref = make(), make()
    state = lazy.create_table_state(opt, 30, 4, np.float32)
    dstate = ref.create_state("k", dense)
    for rnd in range(3):
        rows = np.sort(rng.choice(30, 5, replace=False))[::-1].copy()  # any order
        grad = rng.standard_normal((5, 4)).astype(np.float32)
        lazy.update_every_row(opt, "k", sparse, 30, rows, grad, state)
        full = np.zeros((30, 4), np.float32)
        full[rows] = grad
        ref.update("k", dense, full, dstate)
        assert np.allclose(sparse, dense, rtol=1e-6, atol=1e-7), (name, rnd)
    if name == "adam":
        assert state["t"] == 3
    assert not np.allclose(sparse, w0)


def test_lazy_update_must_be_a_bool():
    assert optim.SGD().lazy_update and not optim.Adam(lazy_update=False).lazy_update
    with pytest.raises(TypeError, match="lazy_update must be True or False"):
        optim.SGD(lazy_update="no")


def test_first_nonfinite_names_the_first_bad_row():
    rows = np.ones((6, 3), np.float32)
    assert first_nonfinite(rows) is None and first_nonfinite(rows[:0]) is None
    rows[4, 1], rows[2, 0] = np.inf, np.nan
    assert first_nonfinite(rows) == 2
    big = np.full((4, 2), 6e4, np.float16)  # the sum overflows, every value is finite
    assert first_nonfinite(big) is None


def test_first_nonfinite_finds_each_kind_alone_and_passes_an_overflowing_span():
    """A lone NaN, +inf or -inf among finite rows is found (the check reads the values' span,
    max less min); finite values whose span overflows are finite all the same."""
    for bad in (np.nan, np.inf, -np.inf):
        rows = np.linspace(-1, 1, 40, dtype=np.float32).reshape(10, 4)
        rows[7, 1] = bad
        assert first_nonfinite(rows) == 7, bad
        assert first_nonfinite(rows[:, ::2]) is None and first_nonfinite(rows[:, 1::2]) == 7
    spread = np.full((4, 2), 6e4, np.float16)
    spread[1] = -6e4  # (max less min overflows float16)
    assert first_nonfinite(spread) is None


def test_pulls_waiting_for_a_round_are_bounded_per_worker():
    """A worker's pulls that wait for an unfinished round are at most MAX_AHEAD; one more is
    refused naming the key, the others are answered when the round ends."""
    from test_replica_rounds import P_ID, W0, W1, _Wire

    from hetps.roles import new_server
    from hetps.tables.server import MAX_AHEAD
    from hetps.transport.codec import Message

    wire = _Wire(ids=(P_ID,))
    srv = new_server(wire.node(P_ID))
    body = {"k": "t", "part": 0, "nparts": 1, "rows": 8, "cols": 2, "dtype": "float32"}
    body.update(scale=0.0, seed=0, bound=0)
    srv.handle(Message("sinit", sender=W0, req=1, body=body))

    def push(worker: int, req: int) -> None:
        arrays = [np.array([1, 3], np.int64), np.ones(4, np.float32)]
        body = {"k": "t", "part": 0, "sync": True}
        srv.handle(Message("spush", sender=worker, req=req, body=body, arrays=arrays))

    def pull(req: int) -> None:
        arrays = [np.array([1, 2], np.int64)]
        srv.handle(Message("spull", sender=W0, req=req, body={"k": "t", "part": 0}, arrays=arrays))

    push(W0, 2)
    for i in range(MAX_AHEAD + 1):
        pull(100 + i)
    errors = [b["error"] for m, b, _ in wire.replies[P_ID] if b and "error" in b]
    assert len(errors) == 1 and "'t'" in errors[0] and "ahead" in errors[0], errors
    push(W1, 3)
    answered = [m.req for m, b, _ in wire.replies[P_ID] if m.cmd == "spull" and not b]
    assert answered == list(range(100, 100 + MAX_AHEAD)), answered
    rows = [a[0].reshape(2, 2) for m, b, a in wire.replies[P_ID] if m.cmd == "spull" and not b]
    assert all(np.array_equal(r, [[2.0, 2.0], [0.0, 0.0]]) for r in rows)


def test_the_id_index_is_a_dict_through_its_merges(monkeypatch):
    """A growing table's IdIndex against a dict, through many adds (the recent array merged
    into the main one several times): every lookup, hits and misses, and its items."""
    from hetps.tables import server_index

    monkeypatch.setattr(server_index, "RECENT_MIN", 50)
    rng = np.random.default_rng(3)
    ix, ref, n = server_index.IdIndex(), {}, 0
    for rnd in range(40):
        fresh = [int(i) for i in rng.integers(0, 1 << 40, 37) if int(i) not in ref]
        fresh = np.array(sorted(set(fresh)), np.int64)
        if rnd % 2:
            fresh = fresh[::-1].copy()  # (not sorted: the index sorts it)
        ix.add(fresh, np.arange(n, n + fresh.size))
        ref.update({int(i): n + j for j, i in enumerate(fresh.tolist())})
        n += fresh.size
        known = rng.choice(np.fromiter(ref, np.int64), 20)
        query = np.concatenate([known, rng.integers(0, 1 << 40, 20), [-5]])
        expect = [ref.get(int(i), -1) for i in query]
        assert ix.lookup(query).tolist() == expect, rnd
    assert len(ix) == len(ref) and ix._ids.size > 0  # (merged at least once)
    ids, locs = ix.items()
    assert ids.tolist() == sorted(ref) and locs.tolist() == [ref[i] for i in sorted(ref)]


def test_a_rounds_sum_adds_each_rows_pushes_in_order():
    """sum_rows against a loop per id: rows pushed by several workers (overlapping ids, some
    in one push only) are summed in push order, s = x_first; s += x_next, bit for bit."""
    from hetps.tables.lazy import sum_rows

    rng = np.random.default_rng(3)
    for _ in range(20):
        pushes = []
        for _w in range(int(rng.integers(2, 5))):
            ids = np.sort(rng.choice(40, int(rng.integers(0, 30)), replace=False)).astype(np.int64)
            pushes.append((ids, rng.standard_normal((ids.size, 3)).astype(np.float32).reshape(-1)))
        ids, rows = sum_rows(pushes, 3, np.float32)
        want: dict[int, np.ndarray] = {}
        for pid, pval in pushes:
            for i, r in zip(pid.tolist(), pval.reshape(-1, 3), strict=True):
                want[i] = r.copy() if i not in want else want[i] + r
        assert ids.tolist() == sorted(want)
        assert rows.tobytes() == np.array([want[i] for i in sorted(want)], np.float32).tobytes()


def test_a_rounds_pushes_of_distinct_ids_are_gathered_once_not_summed(monkeypatch):
    """Where no id is in two pushes (workers' own rows), each row is its push's, bit for bit,
    gathered once in id order (no placing and adding); rows of another dtype, and pushes that
    share an id, take the summing path and give the same as a loop per id."""
    from hetps.tables import lazy

    rng = np.random.default_rng(5)
    perm = rng.permutation(200).astype(np.int64)
    summed: list[int] = []
    real = lazy._summed

    def spy(pushes, *a):
        summed.append(len(pushes))
        return real(pushes, *a)

    monkeypatch.setattr(lazy, "_summed", spy)
    for n in (2, 3, 4):
        cuts = np.sort(rng.choice(np.arange(1, 120), n - 1, replace=False))
        parts = np.split(perm[:120], cuts)  # disjoint, interleaved ids
        pushes = [(np.sort(p), rng.standard_normal((p.size, 3)).astype(np.float32)) for p in parts]
        ids, rows = lazy.sum_rows(pushes, 3, np.float32)
        want = {i: r for pid, pv in pushes for i, r in zip(pid.tolist(), pv, strict=True)}
        assert ids.tolist() == sorted(want)
        assert rows.tobytes() == np.array([want[i] for i in sorted(want)], np.float32).tobytes()
    ends = [
        (np.arange(0, 5), np.ones((5, 3), np.float32)),
        (np.arange(9, 12), np.zeros((3, 3), np.float32)),
    ]
    ids, rows = lazy.sum_rows(ends, 3, np.float32)  # in order end to end
    assert ids.tolist() == [0, 1, 2, 3, 4, 9, 10, 11] and rows.sum() == 15
    assert summed == []  # (none of them placed and added)
    wide = [(np.array([4, 1]), np.ones((2, 3), np.float64)), (np.array([2]), np.ones((1, 3)))]
    wide = [(np.sort(i), r) for i, r in wide]
    ids, rows = lazy.sum_rows(wide, 3, np.float32)  # float64 rows: cast as they are placed
    assert rows.dtype == np.float32 and ids.tolist() == [1, 2, 4] and summed == [2]


def test_owners_are_the_ids_modulo_the_servers():
    """A table's rows go to server ``id % S``: by a mask for a power of two, a modulo else."""
    from hetps.tables.worker import owners

    ids = np.random.default_rng(3).integers(0, 1 << 40, 5000)
    assert owners(ids, 1) is None
    for servers in (2, 3, 4, 5, 8, 12):
        assert np.array_equal(owners(ids, servers), ids % servers), servers


@pytest.mark.parametrize("nparts", [1, 2, 3, 4, 6, 8])
def test_a_parts_ids_and_rows_for_any_number_of_parts(nparts):
    """A server's part takes the ids ``i % nparts == part`` and holds id ``i`` at local row
    ``i // nparts`` (by a mask and a shift where the parts are a power of two), as its
    requests say: a push of every id of the part reaches the right rows, a pull reads them
    back, and an id of another part (or a negative one) is refused naming it."""
    from test_replica_rounds import P_ID, W0, W1, _Wire

    from hetps.roles import new_server
    from hetps.transport.codec import Message

    rows, cols = 61, 2
    for part in range(nparts):
        wire = _Wire(ids=(P_ID,))
        srv = new_server(wire.node(P_ID))
        body = {"k": "t", "part": part, "nparts": nparts, "rows": rows, "cols": cols}
        body.update(dtype="float32", scale=0.0, seed=0, bound=0)
        srv.handle(Message("sinit", sender=W0, req=1, body=body))
        ids = np.arange(part, rows, nparts, dtype=np.int64)
        vals = np.repeat(ids.astype(np.float32), cols)
        key = {"k": "t", "part": part}
        push = {**key, "sync": True}
        srv.handle(Message("spush", sender=W0, req=2, body=push, arrays=[ids, vals]))
        none = [np.zeros(0, np.int64), np.zeros(0, np.float32)]  # (the other worker's part)
        srv.handle(Message("spush", sender=W1, req=2, body=push, arrays=none))
        srv.handle(Message("spull", sender=W0, req=3, body=key, arrays=[ids]))
        others = [i for i in (-nparts + part, *range(rows)) if i % nparts != part or i < 0]
        for req, bad in enumerate(others[:4], 4):
            pull = [np.array([bad], np.int64)]
            srv.handle(Message("spull", sender=W0, req=req, body=key, arrays=pull))
        got = {m.req: (b, a) for m, b, a in wire.replies[P_ID] if m.cmd != "spush"}
        assert [b for m, b, _ in wire.replies[P_ID] if m.cmd == "spush"] == [None, None]
        assert not got[3][0], got
        assert np.array_equal(got[3][1][0], vals)  # (each id its own row, in the pull's order)
        sh = srv.tables.shards[("t", part)]
        assert np.array_equal(sh.value[: ids.size], vals.reshape(-1, cols))  # (row i // S)
        for req, bad in enumerate(others[:4], 4):
            err = got[req][0]["error"]
            assert f"row id {bad} is out of range" in err, (bad, err)
