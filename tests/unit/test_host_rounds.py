"""A server's dist_sync rounds of workers whose hosts are known (kvstore/hostrounds.py):
summed per host in local-rank order, then the hosts in group order, whatever the arrival
order, and the same bytes when each host pushes its own sum (host-local aggregation); a
push that contradicts its round is refused and changes nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetps.roles import new_server
from hetps.transport.codec import Message
from roles import ServerNodeStub

WORKERS = (9, 11, 13, 15)  # two hosts of two: 9, 11 on group 0; 13, 15 on group 1
HOST = {9: (0, 0), 11: (0, 1), 13: (1, 0), 15: (1, 1)}
N = 1000


def _server():
    node = ServerNodeStub(WORKERS)
    srv = new_server(node)
    body = {"k": "w", "part": 0, "size": N, "shape": [N], "dtype": "float32", "off": 0, "n": N}
    srv.handle(Message("init", sender=9, req=1, body=body, arrays=[np.zeros(N, np.float32)]))
    return srv, node


_req = itertools.count(100)


def _push(srv, worker, arr, hg):
    body = {"k": "w", "part": 0, "off": 0, "n": N, "sync": True, "ce": N}
    if hg is not None:
        body["hg"] = list(hg)
    srv.handle(Message("push", sender=worker, req=next(_req), body=body, arrays=[arr]))


def _errors(node) -> list[str]:
    return [b["error"] for _, _, b in node.replies if b and "error" in b]


def _grads(seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    # magnitudes far apart, so that the order of the sum shows in its bits
    return {
        w: (rng.standard_normal(N) * 10.0 ** (2 * i)).astype(np.float32)
        for i, w in enumerate(WORKERS)
    }


def _expected(x: dict[int, np.ndarray]) -> np.ndarray:
    h0 = x[9].copy()
    h0 += x[11]
    h1 = x[13].copy()
    h1 += x[15]
    h0 += h1
    return h0


@pytest.mark.parametrize("order", [(9, 11, 13, 15), (15, 13, 11, 9), (13, 9, 15, 11)])
def test_a_round_is_summed_per_host_in_local_rank_order_whatever_the_arrival(order):
    srv, node = _server()
    x = _grads(0)
    for w in order:
        _push(srv, w, x[w], (*HOST[w], 1))
    value = srv.slices[("w", 0)].value
    assert not _errors(node)
    assert value.tobytes() == _expected(x).tobytes()
    # (the order shows: the flat sum in worker order differs in its bits)
    flat = ((x[9] + x[11]) + x[13]) + x[15]
    assert value.tobytes() != flat.tobytes()


def test_host_sums_counted_for_their_workers_give_the_same_bytes():
    srv, node = _server()
    x = _grads(1)
    sums = {}
    for host, (a, b) in ((0, (9, 11)), (1, (13, 15))):
        s = x[a].copy()
        s += x[b]
        sums[host] = s
    _push(srv, 11, sums[0], (0, 1, 2))  # each host's sum, from the rank that owns the part
    assert srv.slices[("w", 0)].rounds == 0  # it stands for 2 of the 4 workers
    _push(srv, 13, sums[1], (1, 0, 2))
    assert not _errors(node)
    sl = srv.slices[("w", 0)]
    assert sl.rounds == 1
    assert sl.value.tobytes() == _expected(x).tobytes()


def test_pushes_that_contradict_the_round_are_refused_and_change_nothing():
    srv, node = _server()
    x = _grads(2)
    _push(srv, 9, x[9], (0, 0, 1))
    _push(srv, 13, x[13], (0, 0, 1))  # a second "local rank 0 of host 0"
    _push(srv, 11, x[11], (0, 1, 4))  # 1 + 4 workers of a job of 4
    _push(srv, 15, x[15], None)  # no host in a round of hosts
    errors = _errors(node)
    assert len(errors) == 3, errors
    assert "LOCAL_RANK" in errors[0] and "local rank 0 of host group 0" in errors[0]
    assert "stand for 5 workers but the job has 4" in errors[1]
    assert "HETPS_HOST_GROUP" in errors[2] and "every worker or for none" in errors[2]
    # nothing of them was kept: the round completes with the right pushes, as it should
    for w in (11, 13, 15):
        _push(srv, w, x[w], (*HOST[w], 1))
    assert len(_errors(node)) == 3
    sl = srv.slices[("w", 0)]
    assert sl.rounds == 1 and sl.value.tobytes() == _expected(x).tobytes()


def test_a_device_server_sums_hosts_in_the_same_order():
    """On a device server (torch's CPU device: the same code as on CUDA) the round's value
    is the CPU server's, bit for bit."""
    pytest.importorskip("torch")
    from hetps.device import aggregator as ondevice
    from hetps.kvstore.aggregate import Aggregator
    from hetps.kvstore.hostrounds import merge_by_host
    from hetps.kvstore.slices import Slice
    from hetps.roles import DeviceAggregator

    x = _grads(3)
    values = []
    for agg in (
        Aggregator(lambda: 4, lambda: None),
        DeviceAggregator(lambda: 4, lambda: None, ondevice.open_device("torch:cpu")),
    ):
        sl = Slice("w", 0, (N,), np.zeros(N, np.float32))
        for w in (15, 9, 13, 11):  # (arrival order: not the order of the sum)
            sl.hosts[w] = (*HOST[w], 1)
            sl.held[w] = [(0, x[w][:600]), (600, x[w][600:])]  # two chunks each
        merge_by_host(agg, sl)
        agg.finish(sl)
        values.append(np.asarray(sl.value).copy())  # (what pulls read: a host copy)
    assert values[0].tobytes() == _expected(x).tobytes()
    assert values[1].tobytes() == values[0].tobytes()
