"""2-bit compression through a real cluster, against a reference of MXNet's rule written here.

The reference transcribes MXNet's ``quantize_2bit`` (src/kvstore/gradient_compression-inl.h)
element by element, without using :mod:`hetps.kvstore.compression`:

* ``residual += grad`` (float32); ``residual >= t``: code ``11``, ``residual -= t``, decodes to
  ``+t``; ``residual <= -t``: code ``10``, ``residual += t``, decodes to ``-t``; else ``00``, 0.
* 16 values per 32-bit word; value ``i`` of a message lives in byte ``i >> 2`` of the packed
  bytes (little-endian words), at the bit pair ``posbits[i & 3]`` of
  ``posbits = {0xc0, 0x30, 0x0c, 0x03}``, ``negbits = {0x80, 0x20, 0x08, 0x02}``.

Every worker records the words it puts on the wire (per message, each message packing its
own range from its first value) and the values it pulls; the test checks both.
"""

from __future__ import annotations

import numpy as np

from conftest import PER_PROCESS

POSBITS = (0xC0, 0x30, 0x0C, 0x03)
NEGBITS = (0x80, 0x20, 0x08, 0x02)
THRESHOLD = 0.5


def mxnet_quantize_2bit(grad, residual, threshold):
    """MXNet's quantize_2bit on one message's range: (packed uint32 words, decoded values).

    ``residual`` (float32) is updated in place.
    """
    t = np.float32(threshold)
    n = len(grad)
    raw = bytearray(4 * ((n + 15) // 16))
    decoded = np.zeros(n, np.float32)
    for i in range(n):
        r = np.float32(np.float32(residual[i]) + np.float32(grad[i]))
        if r >= t:
            raw[i >> 2] |= POSBITS[i & 3]
            r = np.float32(r - t)
            decoded[i] = t
        elif r <= -t:
            raw[i >> 2] |= NEGBITS[i & 3]
            r = np.float32(r + t)
            decoded[i] = -t
        residual[i] = r
    return np.frombuffer(bytes(raw), dtype="<u4").astype(np.uint32), decoded


def test_reference_itself_on_a_hand_example():
    # values 0..3 share byte 0 (+: 0xc0, -: 0x20, 0, 0), value 4 is byte 1's first (0xc0)
    res = np.zeros(5, np.float32)
    words, dec = mxnet_quantize_2bit(np.float32([1.0, -1.0, 0.25, 0.0, 0.75]), res, 0.5)
    assert words.tolist() == [0x0000C0E0]
    assert dec.tolist() == [0.5, -0.5, 0.0, 0.0, 0.5]
    assert res.tolist() == [0.5, -0.5, 0.25, 0.0, 0.25]
    # the carried residual reaches the thresholds exactly: >= and <= are inclusive
    words, dec = mxnet_quantize_2bit(np.float32([0.0, 0.0, 0.25, -0.5, -0.25]), res, 0.5)
    assert words.tolist() == [0xC0 | 0x20 | 0x0C | 0x02]
    assert dec.tolist() == [0.5, -0.5, 0.5, -0.5, 0.0]
    assert res.tolist() == [0.0] * 5


def _gradients(workers: int, rounds: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    g = rng.uniform(-1, 1, (workers, rounds, n)).astype(np.float32)
    # exact values that hit the thresholds directly and through the carried residual
    g[:, 0, :8] = [0.5, -0.5, 0.25, -0.25, 0.49, -0.49, 0.0, 1.0]
    g[:, 1, :8] = [0.0, 0.0, 0.25, -0.25, 0.01, -0.01, 0.0, 0.0]
    return g


def test_two_bit_words_and_server_values_match_mxnet_reference(cluster, tmp_path):
    workers, rounds, n = 2, 3, 3000
    grads = _gradients(workers, rounds, n)
    np.save(tmp_path / "grads.npy", grads)
    code = f"""
from hetps.cluster import batch
from hetps.cluster import protocol as C
kv = hetps.kv.create('dist_sync')
r = kv.rank
grads = np.load({str(tmp_path / "grads.npy")!r})
kv.init('g', np.zeros(grads.shape[2], np.float32))
kv.set_gradient_compression({{'type': '2bit', 'threshold': {THRESHOLD}}})
sent, rnd = [], [-1]
send = kv.node.van.send
def spy(peer, msg, *a, **kw):
    # a list's small pushes go to a server as one batch: look at its items
    for m in (batch.unpack(msg) if msg.cmd == C.BATCH else [msg]):
        if m.cmd == C.PUSH and m.body.get('k') == 'g':
            b = m.body
            sent.append(((rnd[0], b['part'], b['off'], b['n']), b.get('comp'),
                         np.array(m.arrays[0], copy=True)))
    return send(peer, msg, *a, **kw)
kv.node.van.send = spy
pulled = []
for i in range(grads.shape[1]):
    rnd[0] = i
    kv.push('g', grads[r, i])
    pulled.append(kv.pull('g'))
kv.barrier()
np.savez({str(tmp_path)!r} + f'/sent-{{r}}.npz', pulled=np.array(pulled),
         meta=np.array([s[0] for s in sent]), comp=np.array([s[1] for s in sent]),
         **{{f'w{{j}}': s[2] for j, s in enumerate(sent)}})
print('COMP-REF-OK', flush=True)
"""
    # two servers (the key splits at 1500, not a multiple of 16) and chunks of 1024 values
    env = {"HETPS_BIGARRAY_BOUND": "1000", "HETPS_CHUNK_BYTES": "4096", **PER_PROCESS}
    rc, out = cluster(code, workers=workers, servers=2, env=env)
    assert rc == 0, out
    assert out.count("COMP-REF-OK") == workers, out

    decoded = np.zeros((workers, rounds, n), np.float32)
    for w in range(workers):
        rec = np.load(tmp_path / f"sent-{w}.npz")
        meta, comp = rec["meta"], rec["comp"]
        assert (comp == THRESHOLD).all(), comp
        residual = np.zeros(n, np.float32)
        for i in range(rounds):
            idx = [j for j in range(len(meta)) if meta[j][0] == i]
            # parts are contiguous ranges in part order; a message's offset is within its part
            sizes: dict[int, int] = {}
            for j in idx:
                sizes[int(meta[j][1])] = sizes.get(int(meta[j][1]), 0) + int(meta[j][3])
            starts, at = {}, 0
            for part in sorted(sizes):
                starts[part], at = at, at + sizes[part]
            covered = np.zeros(n, int)
            for j in sorted(idx, key=lambda j: (meta[j][1], meta[j][2])):
                _, part, off, m = (int(v) for v in meta[j])
                a = starts[part] + off
                covered[a : a + m] += 1
                words, dec = mxnet_quantize_2bit(
                    grads[w, i, a : a + m], residual[a : a + m], THRESHOLD
                )
                got = rec[f"w{j}"]
                assert got.dtype == np.uint32, got.dtype
                np.testing.assert_array_equal(
                    got, words, err_msg=f"worker {w} round {i} words of [{a}, {a + m})"
                )
                decoded[w, i, a : a + m] = dec
            assert (covered == 1).all(), f"round {i}: pushes do not cover the key exactly once"
            assert len(sizes) == 2  # the key really was split over both servers
    # the servers decode and sum every worker's push of the round (no optimizer: the sum)
    expect = decoded.sum(axis=0)
    for w in range(workers):
        pulled = np.load(tmp_path / f"sent-{w}.npz")["pulled"]
        for i in range(rounds):
            np.testing.assert_array_equal(pulled[i], expect[i], err_msg=f"worker {w} round {i}")
    assert (expect != 0).any() and (expect == 0).any()
