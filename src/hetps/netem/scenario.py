"""Network scenarios for the emulator: who gets how much bandwidth, and when.
(docs/MODULES.md, "hetps.netem.scenario")"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None  # type: ignore[assignment]

__all__ = [
    "MAX_NODES",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "read_toml",
]

#: Most nodes a scenario may have: one /24 subnet, addresses .1 to .250.
MAX_NODES = 250

_KINDS = ("static", "dynamic")


class ScenarioError(ValueError):
    """A scenario file or dict is invalid; the message names the key and the fix."""


def _err(key: str, problem: str, fix: str) -> ScenarioError:
    return ScenarioError(f"netem scenario: [network] {key}: {problem}; fix: {fix}")


def _number(key: str, value: Any, *, positive: bool = True, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(key, f"expected a number, got {value!r}", f"write {key} = <number>")
    x = float(value)
    if not math.isfinite(x):
        raise _err(key, f"{value!r} is not finite", "use a finite number")
    if positive and (x < 0 or (x == 0 and not allow_zero)):
        bound = ">= 0" if allow_zero else "> 0"
        raise _err(key, f"{value!r} is out of range", f"use a value {bound}")
    return x


def _rate_list(key: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise _err(key, f"expected a non-empty list of rates, got {value!r}", f"{key} = [20, 80]")
    return tuple(_number(f"{key}[{i}]", v) for i, v in enumerate(value))


@dataclass(frozen=True)
class Scenario:
    """A validated network scenario.

    Attributes:
        kind: ``"static"`` or ``"dynamic"``.
        nodes: number of nodes.
        rates_mbit: given rates: one tuple per epoch (a static scenario has exactly one);
            ``None`` when rates are drawn from ``[lo_mbit, hi_mbit]``.
        lo_mbit: lower bound of drawn rates (Mbit/s), or ``None``.
        hi_mbit: upper bound of drawn rates (Mbit/s), or ``None``.
        seed: seed of the drawn rates.
        period_s: epoch length in seconds (dynamic only; ``None`` for static).
        delay_ms: one-way delay added at every node's egress, per node (ms).
        pair_rates_mbit: optional per-destination caps, ``pair_rates_mbit[i][j]`` limits
            traffic from node ``i`` to node ``j`` (the diagonal is ignored).
        tcp_cc: TCP congestion control set inside every node's namespace (e.g. ``"reno"``),
            or ``None`` to keep the host's default.
    """

    kind: str
    nodes: int
    rates_mbit: tuple[tuple[float, ...], ...] | None = None
    lo_mbit: float | None = None
    hi_mbit: float | None = None
    seed: int = 0
    period_s: float | None = None
    delay_ms: tuple[float, ...] = ()
    pair_rates_mbit: tuple[tuple[float, ...], ...] | None = None
    tcp_cc: str | None = None

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, nodes: int | None = None) -> Scenario:
        """Build and validate a scenario from a dict.

        ``data`` is either the whole document (with a ``network`` table) or the ``network``
        table itself. ``nodes`` (e.g. from ``--nodes``) overrides or supplies the node count;
        it must agree with the length of ``rates_mbit`` when both are given.
        """
        if not isinstance(data, Mapping):
            raise ScenarioError(f"netem scenario: expected a table/dict, got {type(data).__name__}")
        if "network" in data:
            extra = sorted(set(data) - {"network"})
            if extra:
                raise ScenarioError(
                    f"netem scenario: unknown top-level key(s) {extra}; "
                    "fix: put every setting under [network]"
                )
            net = data["network"]
            if not isinstance(net, Mapping):
                raise ScenarioError("netem scenario: [network] must be a table")
        else:
            net = data
        keys = [f.name for f in fields(cls)]  # (a key of the file is a field of its own)
        unknown = sorted(set(net) - set(keys))
        if unknown:
            raise ScenarioError(
                f"netem scenario: [network] unknown key(s) {unknown}; "
                f"fix: use only {', '.join(keys)}"
            )

        kind = net.get("kind")
        if kind not in _KINDS:
            raise _err(
                "kind", f"{kind!r} is not a known kind", 'write kind = "static" or "dynamic"'
            )

        n = _node_count(net.get("nodes"), nodes)

        given = net.get("rates_mbit")
        drawn = [k for k in ("lo_mbit", "hi_mbit") if k in net]
        pair = net.get("pair_rates_mbit")
        rates: tuple[tuple[float, ...], ...] | None = None
        lo = hi = None
        if given is not None and drawn:
            raise _err(
                "rates_mbit",
                f"given together with {', '.join(drawn)}",
                "give either rates_mbit or lo_mbit/hi_mbit/seed, not both",
            )
        if given is not None:
            rates = _parse_given_rates(kind, given)
            m = len(rates[0])
            if n is not None and n != m:
                raise _err(
                    "rates_mbit",
                    f"has {m} rates but nodes = {n}",
                    "give one rate per node, or drop nodes / --nodes",
                )
            n = m
        elif drawn:
            if len(drawn) != 2:
                raise _err("lo_mbit/hi_mbit", "only one of the two is given", "give both bounds")
            lo = _number("lo_mbit", net["lo_mbit"])
            hi = _number("hi_mbit", net["hi_mbit"])
            if hi < lo:
                raise _err("hi_mbit", f"{hi:g} < lo_mbit = {lo:g}", "make hi_mbit >= lo_mbit")
            if n is None and pair is None:
                raise _err("nodes", "unknown with drawn rates", "set nodes = N or pass --nodes N")
        elif pair is None:
            raise _err(
                "rates_mbit",
                "no rates given",
                "give rates_mbit = [...] (one per node), or lo_mbit, hi_mbit and seed, "
                "or pair_rates_mbit",
            )

        seed = net.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise _err("seed", f"expected an integer, got {seed!r}", "write seed = 1")

        period = net.get("period_s")
        if kind == "dynamic":
            if period is None:
                raise _err("period_s", "missing for a dynamic scenario", "set period_s = 300")
            period = _number("period_s", period)
            if rates is not None and len(rates) < 2 and lo is None:
                raise _err(
                    "rates_mbit",
                    "a dynamic scenario needs rates that change",
                    "give lo_mbit/hi_mbit/seed, or one list per epoch: "
                    'rates_mbit = [[20, 80], [80, 20]], or use kind = "static"',
                )
        else:
            if period is not None:
                raise _err(
                    "period_s", "set for a static scenario", 'drop it or use kind = "dynamic"'
                )
            if rates is not None and len(rates) != 1:
                raise _err(
                    "rates_mbit",
                    "a list per epoch only makes sense for a dynamic scenario",
                    'use kind = "dynamic" with period_s, or a flat list',
                )

        pair_t: tuple[tuple[float, ...], ...] | None = None
        if pair is not None:
            pair_t = _parse_pair(pair, n)
            n = len(pair_t)

        delay = _parse_delay(net.get("delay_ms", 0), n)
        cc = net.get("tcp_cc")
        if cc is not None and (
            not isinstance(cc, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,15}", cc)
        ):
            raise _err(
                "tcp_cc",
                f"{cc!r} is not the name of a TCP congestion control",
                'write e.g. tcp_cc = "reno" (see sysctl net.ipv4.tcp_available_congestion_control)',
            )
        return cls(
            kind=kind,
            nodes=n,
            rates_mbit=rates,
            lo_mbit=lo,
            hi_mbit=hi,
            seed=seed,
            period_s=period,
            delay_ms=delay,
            pair_rates_mbit=pair_t,
            tcp_cc=cc,
        )

    @classmethod
    def from_file(cls, path: str | Path, *, nodes: int | None = None) -> Scenario:
        """Read a scenario from a TOML file (docs/NETEM.md has the format)."""
        return cls.from_dict(read_toml(path), nodes=nodes)

    @classmethod
    def static(
        cls,
        rates_mbit: Sequence[float],
        *,
        delay_ms: float | Sequence[float] = 0.0,
        pair_rates_mbit: Sequence[Sequence[float]] | None = None,
    ) -> Scenario:
        """Shorthand for a static scenario with given per-node rates."""
        d: dict[str, Any] = {"kind": "static", "rates_mbit": list(rates_mbit)}
        d["delay_ms"] = delay_ms if isinstance(delay_ms, (int, float)) else list(delay_ms)
        if pair_rates_mbit is not None:
            d["pair_rates_mbit"] = [list(r) for r in pair_rates_mbit]
        return cls.from_dict(d)

    # -- queries -----------------------------------------------------------------------------

    @property
    def dynamic(self) -> bool:
        """Whether rates change over time."""
        return self.kind == "dynamic"

    def rates_at(self, epoch: int = 0) -> list[float]:
        """Per-node rates (Mbit/s) in ``epoch``; deterministic for a given seed.

        For drawn rates each epoch has its own generator seeded from ``(seed, epoch)``, so any
        epoch can be computed without computing the ones before it. A static scenario returns
        the epoch-0 rates for every epoch.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not self.dynamic:
            epoch = 0
        if self.rates_mbit is not None:
            return list(self.rates_mbit[epoch % len(self.rates_mbit)])
        if self.lo_mbit is not None and self.hi_mbit is not None:
            rng = random.Random(f"hetps.netem:{self.seed}:{epoch}")
            return [rng.uniform(self.lo_mbit, self.hi_mbit) for _ in range(self.nodes)]
        # Only pair rates: a node may send/receive as fast as its fastest pair allows.
        pr, n = self.pair_rates_mbit or (), range(self.nodes)
        return [max((max(pr[i][j], pr[j][i]) for j in n if j != i), default=1000.0) for i in n]

    def link_rates_at(self, epoch: int = 0) -> list[list[float]]:
        """The effective rate of every directed link ``i -> j`` in ``epoch`` (Mbit/s).

        ``min(rate[i], rate[j], pair[i][j])``: the sender's egress, the receiver's ingress and
        the per-destination cap; the diagonal is 0 (a node does not use the network to reach
        itself). This is the true link matrix a load planner should see, before protocol
        overhead (see docs/NETEM.md).
        """
        r, pair, n = self.rates_at(epoch), self.pair_rates_mbit, range(self.nodes)
        return [
            [min(r[i], r[j], pair[i][j] if pair else r[i]) if i != j else 0.0 for j in n] for i in n
        ]


def _node_count(in_file: Any, override: int | None) -> int | None:
    n = None
    if in_file is not None:
        if isinstance(in_file, bool) or not isinstance(in_file, int):
            raise _err("nodes", f"expected an integer, got {in_file!r}", "write nodes = 4")
        n = in_file
    if override is not None:
        n = override
    if n is not None and not 1 <= n <= MAX_NODES:
        raise _err("nodes", f"{n} is out of range", f"use 1 <= nodes <= {MAX_NODES}")
    return n


def _parse_given_rates(kind: str, value: Any) -> tuple[tuple[float, ...], ...]:
    if isinstance(value, Sequence) and value and not isinstance(value, (str, bytes)):
        if all(isinstance(v, Sequence) and not isinstance(v, (str, bytes)) for v in value):
            epochs = tuple(_rate_list(f"rates_mbit[{k}]", v) for k, v in enumerate(value))
            m = len(epochs[0])
            for k, e in enumerate(epochs):
                if len(e) != m:
                    raise _err(
                        f"rates_mbit[{k}]",
                        f"has {len(e)} rates, epoch 0 has {m}",
                        "give the same number of rates (one per node) in every epoch",
                    )
            if m > MAX_NODES:
                raise _err("rates_mbit", f"{m} nodes", f"use at most {MAX_NODES} nodes")
            return epochs
    flat = _rate_list("rates_mbit", value)
    if len(flat) > MAX_NODES:
        raise _err("rates_mbit", f"{len(flat)} nodes", f"use at most {MAX_NODES} nodes")
    return (flat,)


def _parse_pair(value: Any, n: int | None) -> tuple[tuple[float, ...], ...]:
    key = "pair_rates_mbit"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise _err(key, f"expected a square matrix, got {value!r}", f"{key} = [[0, 10], [20, 0]]")
    m = len(value)
    if n is not None and m != n:
        raise _err(key, f"has {m} rows for {n} nodes", "give one row per node")
    if m > MAX_NODES:
        raise _err(key, f"{m} nodes", f"use at most {MAX_NODES} nodes")
    rows = []
    for i, row in enumerate(value):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != m:
            raise _err(f"{key}[{i}]", f"expected a row of {m} rates, got {row!r}", "make it square")
        cells = [_number(f"{key}[{i}][{j}]", v, allow_zero=i == j) for j, v in enumerate(row)]
        rows.append(tuple(0.0 if j == i else c for j, c in enumerate(cells)))
    return tuple(rows)


def _parse_delay(value: Any, n: int) -> tuple[float, ...]:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise _err(
                "delay_ms", f"has {len(value)} entries for {n} nodes", "one per node, or one number"
            )
        return tuple(_number(f"delay_ms[{i}]", v, allow_zero=True) for i, v in enumerate(value))
    d = _number("delay_ms", value, allow_zero=True)
    return (d,) * n


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file into a dict, with errors that say what to fix."""
    p = Path(path)
    if _toml is None:  # pragma: no cover - Python 3.10 without tomli
        raise ScenarioError(
            "netem scenario: reading TOML needs Python >= 3.11 (tomllib) or the tomli "
            "package; fix: pip install tomli, or pass the scenario as a dict / flags"
        )
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"netem scenario: cannot read {p}: {e}; fix: check the path") from e
    try:
        return _toml.loads(text)
    except _toml.TOMLDecodeError as e:
        raise ScenarioError(f"netem scenario: {p} is not valid TOML: {e}") from e


def load_scenario(source: str | Path | Mapping[str, Any], *, nodes: int | None = None) -> Scenario:
    """Load a scenario from a TOML path or a dict (``nodes`` as in :meth:`Scenario.from_dict`)."""
    if isinstance(source, Mapping):
        return Scenario.from_dict(source, nodes=nodes)
    return Scenario.from_file(source, nodes=nodes)
