"""The link model: what a plan costs on a network whose nodes' sending and receiving are capped.
(docs/MODULES.md, "hetps.balance.network")"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "LoadModel",
    "Network",
    "iteration_time",
    "resolve_roles",
    "server_times",
]

NodeCaps = Literal["max", "sum", "none"]


def _as_rates(name: str, values: ArrayLike, ndim: int) -> np.ndarray:
    arr = np.array(values, dtype=float, copy=True)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-d array of bytes/s, got shape {arr.shape}")
    return arr


@dataclass(frozen=True, eq=False)
class Network:
    """Per-node send/receive caps and optional per-link caps, all in bytes/s.

    ``up[i]`` caps everything node ``i`` sends, ``down[i]`` everything it receives,
    ``link[i, j]`` (if given) what ``i`` sends to ``j``. ``inf`` is "uncapped", ``0`` is "cannot
    carry anything". The diagonal of ``link`` is ignored (a co-located worker and server do not
    use the network).
    """

    up: np.ndarray
    down: np.ndarray
    link: np.ndarray | None = None

    def __post_init__(self) -> None:
        up = _as_rates("up", self.up, 1)
        down = _as_rates("down", self.down, 1)
        if up.size == 0:
            raise ValueError("a network needs at least one node")
        if down.shape != up.shape:
            raise ValueError(f"up has {up.size} nodes but down has {down.size}")
        for name, arr in (("up", up), ("down", down)):
            if np.isnan(arr).any():
                raise ValueError(f"{name} contains NaN; use inf for an uncapped node")
            if (arr < 0).any():
                bad = int(np.flatnonzero(arr < 0)[0])
                raise ValueError(f"negative bandwidth {name}[{bad}] = {arr[bad]} bytes/s")
        link = None
        if self.link is not None:
            link = _as_rates("link", self.link, 2)
            if link.shape != (up.size, up.size):
                raise ValueError(f"link must be {up.size}x{up.size}, got shape {link.shape}")
            np.fill_diagonal(link, np.inf)
            if np.isnan(link).any():
                raise ValueError("link contains NaN; use inf for an uncapped link")
            if (link < 0).any():
                i, j = (int(v) for v in np.argwhere(link < 0)[0])
                raise ValueError(f"negative bandwidth link[{i}][{j}] = {link[i, j]} bytes/s")
            link.setflags(write=False)
        up.setflags(write=False)
        down.setflags(write=False)
        object.__setattr__(self, "up", up)
        object.__setattr__(self, "down", down)
        object.__setattr__(self, "link", link)

    @property
    def n_nodes(self) -> int:
        """Number of nodes."""
        return int(self.up.size)

    @classmethod
    def from_rates(
        cls,
        up: ArrayLike,
        down: ArrayLike | None = None,
        link: ArrayLike | None = None,
    ) -> Network:
        """Network from true shaping rates (bytes/s); ``down`` defaults to ``up``."""
        return cls(np.asarray(up, float), np.asarray(up if down is None else down, float), link)

    @classmethod
    def from_matrix(cls, bw: ArrayLike, node_caps: NodeCaps = "sum") -> Network:
        """Network from a measured link-throughput matrix ``bw[i][j]`` (bytes/s, i sends to j).
        ``node_caps``: ``"sum"`` (all flows at once), ``"max"`` (isolated probes) or ``"none"``
        (independent links); NaN: not measured (docs/MODULES.md, "hetps.balance.network")."""
        if node_caps not in ("max", "sum", "none"):
            raise ValueError(f"node_caps must be 'max', 'sum' or 'none', got {node_caps!r}")
        m = _as_rates("bw", bw, 2)
        n = m.shape[0]
        if m.shape != (n, n) or n == 0:
            raise ValueError(f"bw must be a non-empty square matrix, got shape {m.shape}")
        off = ~np.eye(n, dtype=bool)
        vals = m[off]
        if (vals[~np.isnan(vals)] < 0).any():
            i, j = (int(v) for v in np.argwhere(off & (m < 0))[0])
            raise ValueError(f"negative bandwidth bw[{i}][{j}] = {m[i, j]} bytes/s")
        known = vals[~np.isnan(vals)]
        if np.isnan(vals).any():
            if known.size == 0:
                raise ValueError("bw has no measured off-diagonal entry")
            m[off & np.isnan(m)] = float(np.median(known))
        np.fill_diagonal(m, np.nan)
        if n == 1:
            inf = np.full(1, np.inf)
            return cls(inf, inf.copy(), None)
        if node_caps == "max":
            return cls(np.nanmax(m, axis=1), np.nanmax(m, axis=0), np.nan_to_num(m, nan=np.inf))
        if node_caps == "sum":
            return cls(np.nansum(m, axis=1), np.nansum(m, axis=0), None)
        inf = np.full(n, np.inf)
        return cls(inf, inf.copy(), np.nan_to_num(m, nan=np.inf))


def resolve_roles(
    n_nodes: int,
    servers: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate server and worker node ids; both default to every node (co-located layout)."""
    out = []
    for name, ids in (("servers", servers), ("workers", workers)):
        ids = tuple(range(n_nodes)) if ids is None else tuple(int(i) for i in ids)
        if not ids:
            raise ValueError(f"{name} is empty: at least one node must be a {name[:-1]}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name} lists a node twice: {list(ids)}")
        bad = [i for i in ids if not 0 <= i < n_nodes]
        if bad:
            raise ValueError(f"{name} has node ids {bad} outside 0..{n_nodes - 1}")
        out.append(ids)
    return out[0], out[1]


@dataclass(frozen=True, eq=False)
class LoadModel:
    """Affine loads of every capped resource as a function of the share fractions.

    With ``f = x / total`` (fractions summing to 1) resource ``r`` carries
    ``scale * (beta[r] + A[r] @ f)`` bytes per iteration and takes that divided by ``cap[r]``
    seconds; ``scale = total * unit_bytes``. Resources with an infinite cap or no load are left
    out. ``names[r]`` says which resource row ``r`` is (``"send 3"``, ``"recv 0"``,
    ``"link 2->5"``).
    """

    A: np.ndarray
    beta: np.ndarray
    cap: np.ndarray
    names: tuple[str, ...]
    scale: float
    servers: tuple[int, ...]
    workers: tuple[int, ...]

    @classmethod
    def build(
        cls,
        network: Network,
        total: float,
        servers: Sequence[int] | None = None,
        workers: Sequence[int] | None = None,
        *,
        unit_bytes: float = 1.0,
    ) -> LoadModel:
        """Build the load model of ``network`` for a model of ``total`` units."""
        if not (total >= 0 and math.isfinite(total)):
            raise ValueError(f"total must be a finite number >= 0, got {total}")
        if not (unit_bytes > 0 and math.isfinite(unit_bytes)):
            raise ValueError(f"unit_bytes must be > 0, got {unit_bytes}")
        servers, workers = resolve_roles(network.n_nodes, servers, workers)
        n = network.n_nodes
        n_w = len(workers)
        n_s = len(servers)
        pos = np.full(n, -1, dtype=np.int64)  # column of each node's server, -1: none
        pos[list(servers)] = np.arange(n_s)
        is_w = np.zeros(n, dtype=bool)
        is_w[list(workers)] = True
        is_s = pos >= 0
        # rows in this order, each kept when its cap is finite and it carries something:
        # "send i", "recv i" for every node i, then "link i->j" for every ordered pair
        # (vectorised; the same rows, values and names as one loop over them)
        # -- per-node caps: a server's pulls go to the n_w - [w] other workers; the own
        # worker's push of M - x_i (instead of M) lowers the coefficient by one more when
        # co-located. A worker sends and receives the whole model once (beta 1).
        node = np.repeat(np.arange(n), 2)
        recv = np.tile([False, True], n)
        c_node = np.where(recv, network.down[node], network.up[node])
        coef = (n_w - 2 * is_w.astype(np.int64)).astype(float)[node]
        b_node = is_w[node].astype(float)
        carries = is_s[node] & (coef != 0)
        keep = ~np.isinf(c_node) & ((b_node != 0) | carries)
        node, recv, c_node, coef, b_node, carries = (
            v[keep] for v in (node, recv, c_node, coef, b_node, carries)
        )
        a_node = np.zeros((node.size, n_s))
        rows = np.flatnonzero(carries)
        a_node[rows, pos[node[rows]]] = coef[rows]
        names = [
            f"{'recv' if r else 'send'} {i}"
            for i, r in zip(node.tolist(), recv.tolist(), strict=True)
        ]
        parts_a, parts_b, parts_c = [a_node], [b_node], [c_node]
        if network.link is not None:
            src, dst = np.divmod(np.arange(n * n), n)
            off = src != dst
            src, dst = src[off], dst[off]
            push = is_w[src] & is_s[dst]  # worker src pushes dst's share
            pull = is_s[src] & is_w[dst]  # server src's share pulled by worker dst
            c_link = network.link[src, dst]
            keep = ~np.isinf(c_link) & (push | pull)
            src, dst, push, pull, c_link = (v[keep] for v in (src, dst, push, pull, c_link))
            a_link = np.zeros((src.size, n_s))
            rows = np.flatnonzero(push)
            a_link[rows, pos[dst[rows]]] += 1.0
            rows = np.flatnonzero(pull)
            a_link[rows, pos[src[rows]]] += 1.0
            names += [f"link {i}->{j}" for i, j in zip(src.tolist(), dst.tolist(), strict=True)]
            parts_a.append(a_link)
            parts_b.append(np.zeros(src.size))
            parts_c.append(c_link)
        A = np.concatenate(parts_a).reshape(-1, n_s)
        beta = np.concatenate(parts_b)
        cap = np.concatenate(parts_c).astype(float)
        return cls(
            A=A,
            beta=beta,
            cap=cap,
            names=tuple(names),
            scale=float(total) * float(unit_bytes),
            servers=servers,
            workers=workers,
        )

    @property
    def n_servers(self) -> int:
        """Number of servers (columns of ``A``)."""
        return len(self.servers)

    @property
    def separable(self) -> bool:
        """True when every resource carries at most one server's share, with a non-negative
        coefficient: then each server's time depends on its own share only and the optimum has
        a closed form (node caps only, or per-link caps without co-location)."""
        return bool(((self.A != 0).sum(axis=1) <= 1).all() and (self.A >= 0).all())

    def check_feasible(self) -> None:
        """Raise ValueError if some traffic the plan cannot avoid must cross a zero-rate
        resource (e.g. a worker whose send rate is 0)."""
        bad = (self.cap == 0) & (self.beta > 0)
        if bad.any() and self.scale > 0:
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"resource '{self.names[r]}' has rate 0 but must carry "
                f"{self.scale * self.beta[r]:g} bytes whatever the plan; "
                "remove that node from the workers or measure its links again"
            )

    def loads(self, f: ArrayLike) -> np.ndarray:
        """Bytes each resource carries for share fractions ``f``."""
        return self.scale * (self.beta + self.A @ np.asarray(f, dtype=float))

    def resource_times(self, f: ArrayLike) -> np.ndarray:
        """Seconds each resource needs for share fractions ``f`` (inf: load on a zero rate)."""
        load = self.loads(f)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = load / self.cap
        zero = self.cap == 0
        t[zero] = np.where(load[zero] > 1e-12 * max(self.scale, 1.0), np.inf, 0.0)
        return t

    def time(self, f: ArrayLike) -> float:
        """Predicted communication time of one iteration: the slowest resource."""
        t = self.resource_times(f)
        return float(t.max()) if t.size else 0.0

    def server_times(self, f: ArrayLike) -> np.ndarray:
        """Predicted time of each server: the slowest resource carrying any of its share."""
        t = self.resource_times(f)
        touch = self.A != 0
        if not t.size:
            return np.zeros(self.n_servers)
        out = np.where(touch, t[:, None], -np.inf).max(axis=0)
        return np.maximum(out, 0.0)


def _shares_model(
    network: Network,
    shares: ArrayLike,
    servers: Sequence[int] | None,
    workers: Sequence[int] | None,
    unit_bytes: float,
) -> tuple[LoadModel, np.ndarray]:
    x = np.asarray(shares, dtype=float)
    total = float(x.sum())
    model = LoadModel.build(network, total, servers, workers, unit_bytes=unit_bytes)
    if x.shape != (model.n_servers,):
        raise ValueError(f"expected {model.n_servers} shares, got shape {x.shape}")
    if (x < 0).any():
        raise ValueError("shares must be >= 0")
    f = x / total if total > 0 else np.zeros_like(x)
    return model, f


def iteration_time(
    network: Network,
    shares: ArrayLike,
    servers: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
    *,
    unit_bytes: float = 1.0,
) -> float:
    """Predicted communication time (s) of one iteration with ``shares`` (units; model size is
    their sum) on ``network``."""
    model, f = _shares_model(network, shares, servers, workers, unit_bytes)
    return model.time(f)


def server_times(
    network: Network,
    shares: ArrayLike,
    servers: Sequence[int] | None = None,
    workers: Sequence[int] | None = None,
    *,
    unit_bytes: float = 1.0,
) -> np.ndarray:
    """Predicted time (s) of each server: its slowest resource under ``shares``."""
    model, f = _shares_model(network, shares, servers, workers, unit_bytes)
    return model.server_times(f)
