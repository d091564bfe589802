"""A worker joining a running job (HETPS_ELASTIC), a part of
:class:`hetps.kvstore.client.DistKVStore` (which calls it through ``kv.join()``,
``kv.admit()``, ``kv.declare()``) and takes as an argument (``joining=Joining``, given by
:func:`hetps.roles.new_worker_store`). (docs/MODULES.md, "hetps.faults.joining")"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetps.cluster import protocol as P
from hetps.cluster.requests import wait_all
from hetps.kvstore.base import normalize_keys, per_key, reduce_values, settle, staged_call
from hetps.kvstore.keys import KeyMeta
from hetps.kvstore.ports import StorePort
from hetps.tables.rowsparse import Table, declaration_differs, table_declaration
from hetps.transport.codec import Message


class Joining:
    """join / admit of the store ``kv``."""

    def __init__(self, kv: StorePort) -> None:
        self.kv = kv
        self._joined = False
        self._rounds: dict[Any, int] = {}  # the job's round count per key, given at the join

    @property
    def rejoining(self) -> bool:
        """Whether this worker was started again after it died and the job went on without
        it: call :meth:`join` before any round (its pushes are refused until then)."""
        return bool(self.kv.node.recovery) and not self._joined

    @property
    def joining(self) -> bool:
        """Whether a worker waits to join: the live workers let it in with :meth:`admit` at
        a round boundary that all of them take (e.g. decided by a value summed in a round)."""
        return bool(self.kv.node.joining)

    def admit(self, state: bytes | None = None) -> None:
        """Let the workers that wait to join in (every live worker calls it, at the same round
        boundary). The first live worker (``live_rank`` 0) passes ``state``: the bytes a
        joiner starts from (its model, say); the others' ``state`` is not used. Returns once
        they are in: from the next round on they count in every sum."""
        self.kv.wait_outstanding()
        lead = self.kv.live_rank == 0
        arrays = [np.frombuffer(state, np.uint8)] if lead and state is not None else []
        body = {}
        if lead:
            body["rounds"] = [[k, m.rounds] for k, m in self.kv.meta.items()]
            body["rounds"] += [[k, tm.rounds] for k, tm in self.kv.sparse.tables.items()]
            # the row-sparse keys: a joiner declares those it does not know (made meanwhile)
            body["tables"] = [
                [k, table_declaration(tm.table)] for k, tm in self.kv.sparse.tables.items()
            ]
        fut = self.kv.node.request(P.SCHEDULER_ID, Message(P.ADMIT, body=body, arrays=arrays))
        fut.wait(self.kv.timeout)

    def join(self) -> bytes | None:
        """This worker was started again (:attr:`rejoining`): wait until the live workers
        admit it at a round boundary, then take part in every round from the next on.
        Returns the state the first live worker gave (None if it gave none). Keys that
        exist already are made known with :meth:`declare`, or ``init``: until it joined, a
        worker started again leads nothing (``live_rank`` -1), so its ``init`` sends
        nothing."""
        if not self.rejoining:
            raise RuntimeError(
                "join: this worker is in the job's rounds already; only a worker started "
                "again after it died and the job went on without it joins"
            )
        if self.kv.balance:
            raise RuntimeError(
                "join: joining a running job is not built with HETPS_BALANCE (the joiner "
                "would need the plan's layout of every key and the planner's rounds); the "
                "job goes on without this worker"
            )
        reply = self.kv.node.request(P.SCHEDULER_ID, Message(P.JOIN)).wait(self.kv.timeout)
        state = bytes(reply.arrays[0].reshape(-1).view(np.uint8)) if reply.arrays else None
        answer = reply.typed  # (a JoinAnswer, checked)
        self._rounds = {_key(k): n for k, n in answer.rounds}
        for k, meta in self.kv.meta.items():  # (a push says which round it is of: replicas)
            meta.rounds = self._rounds.get(k, meta.rounds)
        self._join_tables(answer.tables)
        for k, tm in self.kv.sparse.tables.items():  # (a table's push says its round too)
            tm.rounds = self._rounds.get(k, tm.rounds)
        # every server counts this worker from now on; the live workers wait meanwhile
        futs = [self.kv.node.request(s.id, Message(P.ENTER)) for s in self.kv.node.live_servers()]
        wait_all(futs, self.kv.timeout, "join")
        for group, n in answer.barriers.items():
            self.kv.node.barrier_n[group] = self.kv.node.barrier_passed[group] = n
        self.kv.node.request(P.SCHEDULER_ID, Message(P.ENTERED)).wait(self.kv.timeout)
        self._joined = True
        return state

    def _join_tables(self, tables: Any) -> None:
        """Declare the job's row-sparse keys as the first live worker has them (those this
        worker declared itself must match: its pushes would land on other rows)."""
        for entry in tables:
            try:
                k, decl = entry
                table = Table(**decl)
            except (TypeError, ValueError) as exc:
                raise RuntimeError(
                    f"join: the live workers sent a bad table {entry!r}: {exc}"
                ) from None
            k = _key(k)
            tm = self.kv.sparse.tables.get(k)
            if tm is None:
                self.kv.sparse.init_table(k, table, False)  # (sends nothing: the servers have it)
                continue
            differ = declaration_differs(table_declaration(tm.table), decl, "the running job has")
            if differ:
                raise RuntimeError(
                    f"join: this worker declared table {k!r} with {differ}; declare it as the "
                    "job does"
                )

    def declare(self, key: Any, value: Any) -> None:
        """Make keys that exist on the servers already known to this worker (their shape,
        dtype and placement), with no request and no barrier: a worker that joined a running
        job uses it for keys the others made while it was away."""
        keys, is_list = normalize_keys(key)
        with staged_call():
            for k, entry in zip(keys, per_key(value, len(keys), is_list, "declare"), strict=False):
                arr, _ = reduce_values(entry, f"declare of key {k!r}")
                if k not in self.kv.meta:
                    self.kv.order.append(k)
                self.kv.meta[k] = KeyMeta(
                    tuple(arr.shape), arr.dtype, self.kv.placement(k, arr.size)
                )
                self.kv.meta[k].rounds = self._rounds.get(k, 0)
        settle([])


def _key(k: Any) -> Any:
    """A key as msgpack gives it back (a list never is one)."""
    return tuple(k) if isinstance(k, list) else k
