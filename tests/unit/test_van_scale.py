"""The van at scale: a scheduler holds one DEALER per node (benchmarks/scale_sim.py)."""

from __future__ import annotations

import resource

import pytest

from hetps.transport.van import Van

PEERS = 1100  # above ZeroMQ's default limit of 1023 sockets per context


def test_van_connects_to_more_than_a_thousand_peers():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * PEERS + 256  # a mailbox per socket, both ends of each loopback connection
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    van = Van()
    try:
        for peer in range(PEERS):
            van.connect(peer, f"127.0.0.1:{van.port}")
        assert van.has_peer(PEERS - 1)
    finally:
        van.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
