"""LoadModel.build, vectorised, against the loop it replaced (kept here as the reference): the
same rows, in the same order, with the same names, coefficients and caps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetps.balance import LoadModel, Network, resolve_roles


def reference_build(network, total, servers=None, workers=None, *, unit_bytes=1.0):
    """The loop of LoadModel.build before it was vectorised: (A, beta, cap, names)."""
    if not (total >= 0 and math.isfinite(total)):
        raise ValueError(f"total must be a finite number >= 0, got {total}")
    if not (unit_bytes > 0 and math.isfinite(unit_bytes)):
        raise ValueError(f"unit_bytes must be > 0, got {unit_bytes}")
    servers, workers = resolve_roles(network.n_nodes, servers, workers)
    pos = {node: k for k, node in enumerate(servers)}
    is_worker = set(workers)
    n_w = len(workers)
    n_s = len(servers)
    rows: list[np.ndarray] = []
    beta: list[float] = []
    cap: list[float] = []
    names: list[str] = []

    def add(name: str, a: np.ndarray, b: float, c: float) -> None:
        if math.isinf(c) or (b == 0 and not a.any()):
            return
        rows.append(a)
        beta.append(b)
        cap.append(c)
        names.append(name)

    for i in range(network.n_nodes):
        w = i in is_worker
        a = np.zeros(n_s)
        if i in pos:
            # server pulls go to the n_w - [w] other workers; the own worker's push of
            # M - x_i (instead of M) lowers the coefficient by one more when co-located
            a[pos[i]] = n_w - 2 * int(w)
        b = 1.0 if w else 0.0
        add(f"send {i}", a, b, float(network.up[i]))
        add(f"recv {i}", a.copy(), b, float(network.down[i]))
    if network.link is not None:
        for i in range(network.n_nodes):
            for j in range(network.n_nodes):
                if i == j:
                    continue
                a = np.zeros(n_s)
                if i in is_worker and j in pos:
                    a[pos[j]] += 1.0  # push of j's share from worker i
                if i in pos and j in is_worker:
                    a[pos[i]] += 1.0  # pull of i's share by worker j
                add(f"link {i}->{j}", a, 0.0, float(network.link[i, j]))
    A = np.array(rows, dtype=float).reshape(len(rows), n_s)
    return A, np.array(beta, dtype=float), np.array(cap, dtype=float), tuple(names)


@pytest.mark.parametrize("seed", range(30))
def test_vectorised_build_equals_the_loop(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    levels = np.array([0.0, 1e6, 5e6, np.inf])
    up = rng.choice(levels, size=n, p=[0.05, 0.4, 0.4, 0.15])
    down = rng.choice(levels, size=n, p=[0.05, 0.4, 0.4, 0.15])
    link = rng.choice(levels, size=(n, n)) if rng.random() < 0.5 else None
    net = Network(up, down, link)
    kind = rng.integers(0, 3)
    if kind == 0 or n == 1:
        servers = workers = None
    else:
        perm = [int(x) for x in rng.permutation(n)]
        k = int(rng.integers(1, n))
        servers = sorted(perm[:k])
        workers = sorted(perm[k:]) if kind == 1 else sorted(perm[max(0, k - 2) :])
    A, beta, cap, names = reference_build(net, 3.0, servers, workers, unit_bytes=2.0)
    m = LoadModel.build(net, 3.0, servers, workers, unit_bytes=2.0)
    assert m.names == names
    assert m.A.shape == A.shape and m.A.tobytes() == A.tobytes()
    assert m.beta.tobytes() == beta.tobytes() and m.cap.tobytes() == cap.tobytes()
    assert m.scale == 6.0
