"""The server's merge of a dist_sync round: pushes are summed straight into the merge buffer
on the kernel threads, and 2-bit pushes are decoded into it (no decoded copy), with the sums
bit for bit those of adding decoded arrays in arrival order."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.kvstore import compression
from hetps.kvstore.compression import TwoBitCompressor
from hetps.kvstore.server import KVServer
from hetps.optim import kernels
from hetps.roles import new_server
from hetps.transport.codec import Message
from roles import ServerNodeStub

WORKERS = (9, 11, 13)
CE = 4 * kernels.CHUNK + 48  # elements per pushed chunk (a multiple of 16)
N = 3 * CE + 1000  # the part: three whole chunks and a short one


@pytest.fixture(autouse=True)
def two_threads():
    kernels.set_threads(2)
    yield
    kernels.set_threads(0)


def _server() -> tuple[KVServer, ServerNodeStub]:
    node = ServerNodeStub(WORKERS)
    srv = new_server(node)
    body = {"k": "w", "part": 0, "size": N, "shape": [N], "dtype": "float32", "off": 0, "n": N}
    srv.handle(Message("init", sender=9, req=1, body=body, arrays=[np.zeros(N, np.float32)]))
    return srv, node


def _grads(seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {w: rng.standard_normal(N).astype(np.float32) for w in WORKERS}


def _push(srv, worker, off, arr, req, comp=None):
    body = {"k": "w", "part": 0, "off": off, "n": min(CE, N - off), "sync": True, "ce": CE}
    if comp is not None:
        body["comp"] = comp
    srv.handle(Message("push", sender=worker, req=req, body=body, arrays=[arr]))


def test_a_round_of_chunked_pushes_sums_in_arrival_order():
    srv, node = _server()
    grads = _grads(0)
    req = iter(range(100, 10_000))
    # interleaved: worker 11's first chunk comes first, so chunk 0 is written by it
    order = [(w, off) for off in range(0, N, CE) for w in (11, 9, 13)]
    for w, off in order:
        _push(srv, w, off, grads[w][off : off + CE], next(req))
    expect = (grads[11] + grads[9]) + grads[13]
    assert srv.slices[("w", 0)].value.tobytes() == expect.tobytes()
    assert not [b for _, _, b in node.replies if b and "error" in b]


def test_2bit_pushes_are_decoded_into_the_merge_buffer_with_the_same_sums(monkeypatch):
    srv, node = _server()
    grads = _grads(1)
    threshold = 0.75
    comp = TwoBitCompressor(threshold)
    packed = {}
    for w in WORKERS:  # as a worker compresses: chunk by chunk, with its residual
        res = np.zeros(N, np.float32)
        packed[w] = [
            comp.compress(grads[w][off : off + CE], res[off : off + CE]) for off in range(0, N, CE)
        ]
    decoded_copies = []
    real = compression.TwoBitCompressor.decompress

    def spy(self, words, n, dtype=np.float32, *, out=None, add=False):
        if out is None:
            decoded_copies.append(n)
        return real(self, words, n, dtype, out=out, add=add)

    monkeypatch.setattr(compression.TwoBitCompressor, "decompress", spy)
    req = iter(range(100, 10_000))
    for i, off in enumerate(range(0, N, CE)):
        for w in (13, 9, 11):
            _push(srv, w, off, packed[w][i], next(req), comp=threshold)
    assert not [b for _, _, b in node.replies if b and "error" in b]
    assert decoded_copies == []  # every chunk went straight into the merge buffer
    monkeypatch.setattr(compression.TwoBitCompressor, "decompress", real)
    dec = {
        w: np.concatenate(
            [comp.decompress(p, min(CE, N - i * CE)) for i, p in enumerate(packed[w])]
        )
        for w in WORKERS
    }
    expect = (dec[13] + dec[9]) + dec[11]
    assert srv.slices[("w", 0)].value.tobytes() == expect.tobytes()


def test_a_whole_part_2bit_push_then_others_sum_exactly():
    """The round's first push of the whole part is decoded into an array of its own (the
    server keeps it as the merge buffer); the next ones are decoded and added into it."""
    srv, _ = _server()
    grads = _grads(2)
    comp = TwoBitCompressor(0.5)
    words = {w: comp.compress(grads[w], np.zeros(N, np.float32)) for w in WORKERS}
    for i, w in enumerate(WORKERS):
        body = {"k": "w", "part": 0, "off": 0, "n": N, "sync": True, "ce": N, "comp": 0.5}
        srv.handle(Message("push", sender=w, req=200 + i, body=body, arrays=[words[w]]))
    dec = [comp.decompress(words[w], N) for w in WORKERS]
    assert srv.slices[("w", 0)].value.tobytes() == ((dec[0] + dec[1]) + dec[2]).tobytes()


def test_a_chunks_first_push_is_held_and_summed_with_the_next_in_one_pass(monkeypatch):
    """A received (not ring-borne) chunk's first push waits as it is; the second is summed
    with it in one pass (nothing of the chunk is written before), the third added to that;
    never more than one push of a chunk is held."""
    srv, node = _server()
    grads = _grads(3)
    sums = []
    real = kernels.sum_into

    def spy(out, arrays):
        sums.append(len(arrays))
        return real(out, arrays)

    monkeypatch.setattr(kernels, "sum_into", spy)
    sl = srv.slices[("w", 0)]
    _push(srv, 9, 0, grads[9][:CE], 100)
    assert len(sl.pending[0]) == 1 and 0 not in sl.written and sums == []
    _push(srv, 11, 0, grads[11][:CE], 101)
    assert sums == [2] and 0 in sl.written and 0 not in sl.pending
    _push(srv, 13, 0, grads[13][:CE], 102)
    assert sums == [2, 2] and not sl.pending
    assert sl.merge[:CE].tobytes() == ((grads[9][:CE] + grads[11][:CE]) + grads[13][:CE]).tobytes()
    req = iter(range(200, 1000))
    for off in range(CE, N, CE):
        for w in WORKERS:
            _push(srv, w, off, grads[w][off : off + CE], next(req))
    expect = (grads[9] + grads[11]) + grads[13]
    assert sl.value.tobytes() == expect.tobytes() and not sl.pending
    assert not [b for _, _, b in node.replies if b and "error" in b]
