"""Lazy updates of a row-sparse table: only the rows a round touched change.

MXNet's ``lazy_update`` semantics for a row-sparse gradient: the optimizer's rule runs on the
rows the gradient names, and every other row keeps its weight *and its state* (momentum,
Adam's moments, AdaGrad's history) as they were. With plain SGD (no momentum) that is the
dense update exactly; with momentum or Adam a dense update would also move the untouched
rows (their momentum decays), which the lazy one does not.

A table's state is a dict of arrays shaped like the table (rows x columns, the compute
dtype), one row per table row, plus Adam's step count ``t`` (counted per table and round,
as MXNet counts updates per key: a round that touched no row of this server's part still
counts).

Rules, for each touched row ``r`` with gradient row ``grad[r]`` (``rescale`` and ``clip`` as
in the dense optimizers):

* SGD: ``g = clip(rescale * grad[r]) + wd * w[r]``; no momentum: ``w[r] -= lr * g``;
  momentum: ``mom[r] = momentum * mom[r] - lr * g; w[r] += mom[r]``.
* Adam: ``g = clip(rescale * grad[r] + wd * w[r])``, ``mean[r] = b1 mean[r] + (1 - b1) g``,
  ``var[r] = b2 var[r] + (1 - b2) g^2``, ``w[r] -= lr_t mean[r] / (sqrt(var[r]) + eps)``
  with ``lr_t = lr sqrt(1 - b2^t) / (1 - b1^t)``.
* AdaGrad: ``g = clip(rescale * grad[r])``, ``hist[r] += g^2``,
  ``w[r] += (g / sqrt(hist[r] + eps) + wd * w[r]) * -lr`` (MXNet's sparse kernel refuses
  ``wd != 0``; here the dense rule's weight decay applies to the touched rows).

An optimizer of another class may define ``create_table_state(rows, cols, dtype)`` and
``update_rows(key, weight, rows, grad, state)`` to serve row-sparse keys itself.

Pure NumPy; of hetps it imports only ``hetps.optim`` (its optimizers, whose dense steps the
rules run).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetps.optim.adagrad import AdaGrad
from hetps.optim.adam import Adam
from hetps.optim.base import Optimizer
from hetps.optim.kernels import NumpyOps
from hetps.optim.sgd import SGD

__all__ = [
    "LazyUnsupported",
    "create_table_state",
    "distinct",
    "distinct_inverse",
    "grow_state",
    "put_rows",
    "take_rows",
    "update_every_row",
    "update_rows",
]


class LazyUnsupported(TypeError):
    """The optimizer has no row-sparse (lazy) rule."""


def take_rows(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``table[rows]`` of a 2-D table, a new array (``np.take``: 3-10x faster than fancy
    indexing for a few thousand rows)."""
    return np.take(table, rows, axis=0)


def put_rows(table: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """``table[rows] = values`` for distinct ``rows`` of a 2-D table, each row moved as one
    item (``np.put`` on a row-wide view: 1.5-3x faster than fancy assignment)."""
    if table.ndim != 2 or not table.flags.c_contiguous or table.shape[1] == 0:
        table[rows] = values
        return
    values = np.ascontiguousarray(values, dtype=table.dtype).reshape(rows.size, table.shape[1])
    item = np.dtype((np.void, table.shape[1] * table.itemsize))
    np.put(table.view(item).reshape(-1), rows, values.view(item).reshape(-1))


def distinct(ids: np.ndarray, runs: bool = False) -> np.ndarray:
    """The sorted distinct values of 1-D ``ids`` (``ids`` itself when it is so already): by
    a sort, as ``np.unique``'s hash path is 10x slower on a few thousand int64 ids; ``runs``:
    sorted runs end to end (a round's pushes), merged by the stable sort (4x faster)."""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids
    s = np.sort(ids, kind="stable" if runs else None)
    keep = np.empty(s.size, bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def distinct_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(sorted distinct ``ids``, where each id of ``ids`` is in it); the inverse is None when
    ``ids`` is sorted and distinct already (it is then its own answer)."""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, None
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    first = np.empty(s.size, bool)
    first[0] = True
    np.not_equal(s[1:], s[:-1], out=first[1:])
    inv = np.empty(ids.size, np.int64)
    inv[order] = np.cumsum(first) - 1
    return s[first], inv


def sum_rows(
    pushes: list[tuple[np.ndarray, np.ndarray]], cols: int, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """A round's per-row sum of ``pushes`` (each sorted distinct ids and their rows), in the
    order given: the union of their ids, sorted, and per id ``s = x_first; s += x_next ...``
    over the pushes that hold it. Servers and hosts (host-local aggregation) sum with it, so
    a host's sum is bit for bit the one a server makes of the host's workers' pushes.

    One stable sort of the ids places every push's rows (no search per push); each push's
    rows are written whole, and only the rows an earlier push holds too are added. Where no
    id is in two pushes (each row is one push's), the rows are gathered once in id order."""
    if len(pushes) == 1:
        return pushes[0][0], pushes[0][1].reshape(-1, cols)
    every = np.concatenate([p[0] for p in pushes])
    dtype = np.dtype(dtype)
    if every.size < 2 or bool((every[1:] > every[:-1]).all()):
        order = s = None  # (their ids in order end to end, none twice: each push's rows follow)
    else:
        order = np.argsort(every, kind="stable")
        s = every[order]
        first = np.empty(s.size, bool)
        first[0] = True
        np.not_equal(s[1:], s[:-1], out=first[1:])
        if not first.all():  # rows two pushes hold: placed, then added (below)
            inv = np.empty(every.size, np.int64)
            inv[order] = np.cumsum(first) - 1
            return _summed(pushes, s[first], inv, cols, dtype)
    if any(p[1].dtype != dtype for p in pushes):  # (rows cast as they are placed)
        inv = np.arange(every.size) if order is None else np.argsort(order)
        return _summed(pushes, every if s is None else s, inv, cols, dtype)
    # no id twice: every row is one push's, taken as it is (one gather, no sum)
    rows = np.concatenate([p[1].reshape(-1, cols) for p in pushes])
    return (every, rows) if order is None else (s, take_rows(rows, order))


def _summed(
    pushes: list[tuple[np.ndarray, np.ndarray]],
    ids: np.ndarray,
    inv: np.ndarray,
    cols: int,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sum_rows` of ``pushes`` whose ids, end to end, are ``ids[inv]``: each push's
    rows written whole, and the rows an earlier push holds too added."""
    grad = np.empty((ids.size, cols), dtype)
    seen = np.zeros(ids.size, bool)
    at = 0
    for pid, pval in pushes:
        pos = inv[at : at + pid.size]
        at += pid.size
        vals = pval.reshape(-1, cols)
        again = np.flatnonzero(seen[pos])  # (rows an earlier push holds: kept, then added)
        kept = take_rows(grad, pos[again]) if again.size else None
        put_rows(grad, pos, vals)
        if kept is not None:
            kept += take_rows(vals, again)
            put_rows(grad, pos[again], kept)
        seen[pos] = True
    return ids, grad


def _added(w: np.ndarray, g: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``w + g`` in ``dt``: into ``w`` (a gathered copy) when it is of that dtype already."""
    return np.add(w, g, out=w) if w.dtype == dt else np.add(w, g, dtype=dt)


def _compute(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def create_table_state(opt: Optimizer, rows: int, cols: int, dtype: Any) -> dict[str, Any]:
    """The state of a table of ``rows`` x ``cols`` for ``opt`` (rows added by :func:`grow_state`)."""
    dt = _compute(dtype)
    if hasattr(opt, "update_rows") and hasattr(opt, "create_table_state"):
        return opt.create_table_state(rows, cols, dt)
    if isinstance(opt, SGD):
        return {"mom": np.zeros((rows, cols), dt)} if opt.momentum != 0.0 else {}
    if isinstance(opt, Adam):
        return {"mean": np.zeros((rows, cols), dt), "var": np.zeros((rows, cols), dt), "t": 0}
    if isinstance(opt, AdaGrad):
        return {"history": np.zeros((rows, cols), dt)}
    raise LazyUnsupported(
        f"{type(opt).__name__} has no row-sparse (lazy) update: use hetps.optim.SGD, Adam or "
        "AdaGrad for row-sparse keys, or give the optimizer create_table_state() and "
        "update_rows()"
    )


def grow_state(state: dict[str, Any], rows: int) -> None:
    """Make every per-row array of ``state`` ``rows`` long (new rows are zeros)."""
    for name, arr in list(state.items()):
        if isinstance(arr, np.ndarray) and arr.ndim == 2 and arr.shape[0] < rows:
            grown = np.zeros((rows, arr.shape[1]), arr.dtype)
            grown[: arr.shape[0]] = arr
            state[name] = grown


#: bytes of one gathered array in a block of :func:`update_rows` (a rule's passes run a block
#: of rows at a time, so the block's weights, state and scratch stay in a core's cache between
#: them: 1.2x faster for Adam on 10,000 rows of 64 than the rows at once)
ROW_BLOCK_BYTES = 1 << 19


def update_rows(
    opt: Optimizer,
    key: Any,
    weight: np.ndarray,
    rows: np.ndarray,
    grad: np.ndarray,
    state: dict[str, Any],
    count: bool = True,
) -> None:
    """Apply ``grad`` (len(rows) x cols) to ``weight[rows]`` (weight: the table, 2-D) in place,
    lazily; ``rows`` are distinct local row indices (possibly none: a round that touched no
    row here still counts for Adam's step; ``count`` False: a further block of the same
    round, not counted again). The rule runs on :data:`ROW_BLOCK_BYTES` of rows at a time,
    each block gathered once and scattered once; every row's result is the same whatever the
    blocks."""
    if hasattr(opt, "update_rows") and hasattr(opt, "create_table_state"):
        opt.update_rows(key, weight, rows, grad, state)
        return
    dt = _compute(weight.dtype)
    if isinstance(opt, Adam) and count:
        state["t"] += 1
    if rows.size == 0:
        return
    rule = next(
        (r for c, r in ((SGD, _sgd), (Adam, _adam), (AdaGrad, _adagrad)) if isinstance(opt, c)),
        None,
    )
    if rule is None:
        create_table_state(opt, 0, 0, weight.dtype)  # raises LazyUnsupported with the fix
    grad = grad.reshape(rows.size, weight.shape[1])
    step = max(1, ROW_BLOCK_BYTES // max(1, grad.shape[1] * dt.itemsize))
    for a in range(0, rows.size, step):
        rule(opt, weight, rows[a : a + step], grad[a : a + step], state, dt)


def _sgd(opt: Any, weight: np.ndarray, rows: np.ndarray, grad: np.ndarray, state: dict, dt: Any):
    """The dense step's arithmetic (:meth:`SGD.rule`) on the gathered rows."""
    w = take_rows(weight, rows)
    mom = take_rows(state["mom"], rows) if opt.momentum != 0.0 else None
    opt.rule(NumpyOps(dt), w, grad, mom, [np.empty(grad.shape, dt) for _ in range(2)])
    if mom is not None:
        put_rows(state["mom"], rows, mom)
    put_rows(weight, rows, w)


def _adam(opt: Any, weight: np.ndarray, rows: np.ndarray, grad: np.ndarray, state: dict, dt):
    """The dense step's arithmetic (:meth:`Adam.rule`) on the gathered rows."""
    t = state["t"]
    lr_t = opt.learning_rate * math.sqrt(1.0 - opt.beta2**t) / (1.0 - opt.beta1**t)
    w = take_rows(weight, rows)
    mean, var = take_rows(state["mean"], rows), take_rows(state["var"], rows)
    opt.rule(NumpyOps(dt), lr_t, w, grad, mean, var, [np.empty(grad.shape, dt) for _ in range(2)])
    put_rows(state["mean"], rows, mean)
    put_rows(state["var"], rows, var)
    put_rows(weight, rows, w)


def _adagrad(opt: Any, weight: np.ndarray, rows: np.ndarray, grad: np.ndarray, state: dict, dt):
    w = take_rows(weight, rows)
    g = opt.preprocess_grad(grad, dt)
    hist = take_rows(state["history"], rows)
    tmp = np.multiply(g, g)
    hist += tmp
    put_rows(state["history"], rows, hist)
    np.add(hist, opt.eps, out=tmp)
    g /= np.sqrt(tmp, out=tmp)
    if opt.wd != 0.0:
        g += np.multiply(w, opt.wd, dtype=dt)
    g *= -opt.learning_rate
    put_rows(weight, rows, _added(w, g, dt))


#: rows updated at once by :func:`update_every_row` (its scratch stays a few MiB)
EVERY_ROW_BLOCK = 1 << 15


def update_every_row(
    opt: Optimizer,
    key: Any,
    weight: np.ndarray,
    count: int,
    rows: np.ndarray,
    grad: np.ndarray,
    state: dict[str, Any],
) -> None:
    """MXNet's ``lazy_update=False`` on a row-sparse gradient: the rule runs on every row of
    ``weight[:count]``, the rows not in ``rows`` with a zero gradient (their momentum decays,
    Adam's moments too, weight decay applies), block by block; the step counts once."""
    cols = weight.shape[1]
    if hasattr(opt, "update_rows") and hasattr(opt, "create_table_state"):
        dense = np.zeros((count, cols), grad.dtype)
        put_rows(dense, rows, grad)
        opt.update_rows(key, weight, np.arange(count), dense, state)
        return
    if count == 0:
        update_rows(opt, key, weight, rows, grad, state)
        return
    order = np.argsort(rows, kind="stable")
    ordered = rows[order]
    for a in range(0, count, EVERY_ROW_BLOCK):
        b = min(count, a + EVERY_ROW_BLOCK)
        lo, hi = np.searchsorted(ordered, [a, b])
        block = np.zeros((b - a, cols), grad.dtype)
        put_rows(block, ordered[lo:hi] - a, take_rows(grad, order[lo:hi]))
        update_rows(opt, key, weight, np.arange(a, b), block, state, count=a == 0)
