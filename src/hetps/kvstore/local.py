"""The single-process KVStore (``local`` and ``device``): MXNet's API in one process."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hetps import optim
from hetps.kvstore.base import (
    Handle,
    check_dtype,
    check_like,
    completed,
    normalize_keys,
    out_arrays,
    per_key,
    reduce_values,
    settle,
    settle_after,
    staged_call,
)
from hetps.kvstore.compression import TwoBitCompressor, parse_compression_params
from hetps.tables.local import LocalSparse
from hetps.tables.worker import is_table


class LocalKVStore(LocalSparse):
    """Keys live in this process. A push sums its values and applies the optimizer if one is
    set (else the sum replaces the value); a pull copies the value out."""

    def __init__(self, name: str = "local") -> None:
        self.type = name
        self.rank = 0
        self.num_workers = 1
        self.live_workers = 1
        self.live_rank = 0
        self.store: dict[Any, np.ndarray] = {}
        self.states: dict[Any, Any] = {}
        self.optimizer: optim.Optimizer | None = None
        self.compressor: TwoBitCompressor | None = None
        self.residuals: dict[Any, np.ndarray] = {}
        self.tables = {}  # row-sparse keys (tables/local.py)

    def short_rounds(self, key: Any) -> list[tuple[int, int, int]]:
        """Always empty: one process, no worker ever leaves."""
        return []

    def _value(self, key: Any, what: str) -> np.ndarray:
        if key in self.tables:
            raise TypeError(
                f"{what} of key {key!r}: a row-sparse key; read its rows with "
                f"kv.row_sparse_pull({key!r}, out=..., row_ids=...)"
            )
        if key not in self.store:
            raise KeyError(
                f"{what}: key {key!r} was never initialised: call kv.init({key!r}, value) first"
            )
        return self.store[key]

    def init(self, key: Any, value: Any) -> None:
        """Store a copy of each value."""
        keys, is_list = normalize_keys(key)
        with staged_call():
            for k, entry in zip(keys, per_key(value, len(keys), is_list, "init"), strict=False):
                if is_table(entry):
                    self._init_table(k, entry)
                    continue
                self.tables.pop(k, None)
                arr, _ = reduce_values(entry, f"init of key {k!r}")
                check_dtype(arr.dtype, k)
                self.store[k] = np.array(arr, copy=True)
        settle([])

    def push(self, key: Any, value: Any, priority: int = 0, block: bool = True) -> Handle:
        """Sum the values and apply them (optimizer or replace)."""
        keys, is_list = normalize_keys(key)
        with staged_call():
            self._push(keys, per_key(value, len(keys), is_list, "push"))
        settle([])
        return completed()

    def _push(self, keys: list, entries: list) -> None:
        for k, entry in zip(keys, entries, strict=False):
            if k in self.tables:
                self._push_table(k, entry)
                continue
            stored = self._value(k, "push")
            arr, _ = reduce_values(entry, f"push of key {k!r}")
            check_like(k, stored, arr, "push")
            if self.compressor is not None:
                res = self.residuals.setdefault(k, np.zeros(arr.size, np.float32))
                packed = self.compressor.compress(np.ascontiguousarray(arr).reshape(-1), res)
                arr = self.compressor.decompress(packed, arr.size, arr.dtype).reshape(arr.shape)
            if self.optimizer is None:
                self.store[k] = np.array(arr, copy=True)
            else:
                if k not in self.states:
                    self.states[k] = self.optimizer.create_state(k, stored)
                self.optimizer.apply_update(k, stored, np.asarray(arr), self.states[k], sender=0)

    def pull(
        self,
        key: Any,
        out: Any = None,
        priority: int = 0,
        block: bool = True,
        ignore_sparse: bool = True,
    ) -> Any:
        """Copy values into ``out`` (or return copies)."""
        keys, is_list = normalize_keys(key)
        results = []
        outs = per_key(out, len(keys), is_list, "pull") if out is not None else [None] * len(keys)
        with staged_call():
            for k, entry in zip(keys, outs, strict=False):
                stored = self._value(k, "pull")
                if self.optimizer is not None and k in self.states:
                    self.optimizer.on_pull(k, stored, self.states[k], sender=0)
                if entry is None:
                    results.append(stored.copy())
                    continue
                for t in out_arrays(entry, f"pull of key {k!r}"):
                    check_like(k, stored, t, "pull")
                    t[...] = stored
        settle_after([])()
        value = None if out is not None else (results if is_list else results[0])
        return value if block else completed(value)

    def pushpull(
        self, key: Any, value: Any, out: Any = None, priority: int = 0, block: bool = True
    ) -> Any:
        """Push, then pull into ``out`` (default: into ``value``)."""
        self.push(key, value, priority)
        return self.pull(key, out if out is not None else value, priority, block)

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Init then pull."""
        self.init(key, value)
        self.pull(key, out, priority)

    def barrier(self) -> None:
        """Nothing to wait for in one process."""

    def set_optimizer(self, optimizer: optim.Optimizer) -> None:
        """Apply ``optimizer`` on every later push."""
        if not isinstance(optimizer, optim.Optimizer):
            raise TypeError(
                f"set_optimizer takes a hetps.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.states = {}

    def set_gradient_compression(self, params: dict) -> None:
        """2-bit compression, as in the distributed store (applied to pushes)."""
        self.compressor = parse_compression_params(params)
        self.residuals = {}

    def save_optimizer_states(self, fname: str) -> None:
        """Write the optimizer states to ``fname``."""
        tmp = f"{fname}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(optim.dump_states(self.states))
        os.replace(tmp, fname)

    def load_optimizer_states(self, fname: str) -> None:
        """Read optimizer states written by :meth:`save_optimizer_states`."""
        with open(fname, "rb") as f:
            self.states = optim.load_states(f.read())

    def close(self, error: str | None = None) -> None:
        """Nothing to release."""
