"""Hosts in the link model (pure: no messages): workers that share a host share its link.

A host's workers (the same ``HETPS_HOST_GROUP``) send and receive over one network link, so
the planner measures and plans per (host, server) pair: one row of the link model per host,
whose busy-time rate is its link's, read from every one of its workers' transfers together
(:class:`HostMap` maps a worker's rank to its host's row). A host of K workers that each push
the whole model carries K times a worker's bytes, and every server receives one push per
worker; :func:`per_host_network` folds both counts into the caps the plan functions see, so
their model (one push per worker row) gives the true times. Workers without a group are each a
host of their own: then every row is a worker and the plans are exactly those without hosts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetps.balance.network import Network

__all__ = ["HostMap", "host_pushes", "per_host_network", "row_lookup", "rows_of"]


class HostMap:
    """Worker ranks to hosts: ``groups[r]`` is worker r's host group (-1: a host of its own).
    Hosts are numbered in order of their lowest worker rank."""

    def __init__(self, groups: Sequence[int]) -> None:
        key = [(int(g), 0) if int(g) >= 0 else (-1, r) for r, g in enumerate(groups)]
        index: dict[tuple[int, int], int] = {}
        self.host_of_rank = np.array([index.setdefault(k, len(index)) for k in key], dtype=np.int64)
        self.n_hosts = len(index)
        first = np.full(self.n_hosts, len(key), dtype=np.int64)
        np.minimum.at(first, self.host_of_rank, np.arange(len(key)))
        self.first_rank = first  # each host's lowest worker rank (it stands for the host)

    @property
    def shared(self) -> bool:
        """Whether some host runs more than one worker (else every row is one worker)."""
        return self.n_hosts < len(self.host_of_rank)


def per_host_network(net: Network, servers: Sequence[int], hosts: HostMap, pushes: np.ndarray):
    """The caps that make the plan functions' model (each worker row sends and receives the
    model once, each server gets one push per worker row) give the true times of hosts whose
    row ``S + h`` pushes ``pushes[h]`` times a round: a host's caps divided by its pushes, a
    server's multiplied by (rows / pushes in all)."""
    up, down = net.up.copy(), net.down.copy()
    srv = np.asarray(list(servers), dtype=np.int64)
    rows = np.setdiff1d(np.arange(net.n_nodes), srv)
    k = np.asarray(pushes, dtype=float)
    up[rows], down[rows] = up[rows] / k, down[rows] / k
    factor = len(rows) / float(k.sum())
    up[srv], down[srv] = up[srv] * factor, down[srv] * factor
    return Network(up, down)


def host_pushes(hosts: HostMap, once: dict[int, bool], live: Sequence[int]) -> np.ndarray:
    """Each host's pushes a round: one for those of its live workers (ranks ``live``) whose
    last report says they aggregate (``once``), and one for each other one; at least one."""
    n = len(hosts.host_of_rank)
    ranks = np.asarray(live, dtype=np.int64)
    ranks = ranks[(ranks >= 0) & (ranks < n)]  # (one joined later: none)
    flags = np.zeros(n + 1, dtype=bool)  # (a rank out of range: the last, unread)
    flags[np.clip(np.fromiter(once, np.int64, len(once)), -1, n)] = list(once.values())
    rows, agg = hosts.host_of_rank[ranks], flags[ranks]
    count, summed = (np.bincount(rows, w, hosts.n_hosts) for w in (None, agg))
    return np.maximum(count - summed + (summed > 0), 1)


def row_lookup(ids: Sequence[int], rows: Sequence[int]) -> np.ndarray:
    """A table from node id to row of the link model (-1: no node), for :func:`rows_of`."""
    lookup = np.full(max(ids, default=0) + 1, -1, dtype=np.int64)
    lookup[np.asarray(ids, dtype=np.int64)] = rows
    return lookup


def rows_of(lookup: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The rows of an array of node ids (as floats, from a report); -1 for what names no
    node (out of range, not a whole number, not finite)."""
    with np.errstate(invalid="ignore"):  # (NaN, inf, past int64: no whole number of its own)
        k = ids.astype(np.int64)
    k[(k != ids) | (k < 0) | (k >= len(lookup))] = len(lookup)
    return np.append(lookup, -1)[k]
