"""Property-based fuzzing of the codec's decoder (hypothesis; bounded examples, no database).

Inputs: random bytes, truncated frames, wrong frame counts, huge declared lengths and wrong
types in every header field, built on valid messages. The decoder either returns a message
that matches what its frames hold, or raises :class:`BadMessage` (never anything else), in
bounded time and memory: nothing it allocates grows with a declared length, only with the
bytes that actually came.
"""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetps.transport.codec import (
    FRAME_MAX,
    MAX_HEADER_BYTES,
    WIRE_DTYPES,
    BadMessage,
    Message,
    decode,
    encode,
)

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BOUND = 1 << 24  # the decoder's size bound in these tests

# any msgpack value, of any type, in any header field
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=5), kids, max_size=4)
    ),
    max_leaves=12,
)
HEADER_FIELDS = ["v", "c", "s", "r", "p", "o", "t", "b", "a", "m"]
huge = st.integers(min_value=2**20, max_value=2**64 - 1)  # what msgpack can carry
shapes = st.lists(st.one_of(st.integers(0, 8), huge, st.integers(-5, -1)), max_size=6)
specs = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(sorted(WIRE_DTYPES) + ["complex64", "object", ""]), shapes).map(
            list
        ),
        values,
    ),
    max_size=4,
)


def _valid(draw_arrays: list[np.ndarray], cmd: str = "push") -> list:
    return [
        bytes(f) if not isinstance(f, bytes) else f
        for f in encode(Message(cmd, req=3, body={"k": "w"}, arrays=draw_arrays))
    ]


arrays = st.lists(
    st.tuples(st.sampled_from(sorted(WIRE_DTYPES)), st.lists(st.integers(0, 5), max_size=3)).map(
        lambda t: np.zeros(t[1], WIRE_DTYPES[t[0]])
    ),
    max_size=3,
)


def _decode(frames: list) -> Message | None:
    """Decode; anything but BadMessage fails the test. Time and memory are bounded by what
    came, not by what the header declares."""
    came = sum(len(f) for f in frames)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        return decode(frames, BOUND)
    except BadMessage as exc:
        assert str(exc)  # it says why
        return None
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 2 * came + (1 << 20), f"decoding {came} bytes took {peak} bytes"
        assert elapsed < 2.0, f"decoding took {elapsed:.1f} s"


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=6))
def test_random_bytes(frames):
    _decode(frames)


@FUZZ
@given(arrays, st.data())
def test_truncated_frames_and_wrong_frame_counts(arrs, data):
    frames = _valid(arrs)
    how = data.draw(st.sampled_from(["cut", "drop", "extra", "split"]))
    i = data.draw(st.integers(0, len(frames) - 1))
    if how == "cut":
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif how == "drop":
        del frames[i]
    elif how == "extra":
        frames.insert(i + 1, data.draw(st.binary(max_size=64)))
    else:
        cut = data.draw(st.integers(0, len(frames[i])))
        frames[i : i + 1] = [frames[i][:cut], frames[i][cut:]]
    out = _decode(frames)
    if out is not None:  # only a change that still matches the header may pass
        assert [a.nbytes for a in out.arrays] == [a.nbytes for a in arrs]


@FUZZ
@given(arrays, st.sampled_from(HEADER_FIELDS), values)
def test_wrong_types_in_every_header_field(arrs, name, value):
    frames = _valid(arrs)
    head = msgpack.unpackb(frames[0], raw=False)
    head[name] = value
    frames[0] = msgpack.packb(head, use_bin_type=True)
    out = _decode(frames)
    if out is not None:
        assert isinstance(out.cmd, str) and isinstance(out.req, int) and isinstance(out.body, dict)
        assert isinstance(out.reply, bool) and isinstance(out.priority, int)
        for a in out.arrays:
            assert a.dtype in WIRE_DTYPES.values()


@FUZZ
@given(specs, st.lists(st.binary(max_size=64), max_size=4))
def test_huge_and_wrong_array_declarations(decl, frames):
    head = {"v": 1, "c": "push", "r": 1, "p": False, "o": 0, "t": 0.0, "b": {}, "a": decl}
    out = _decode([msgpack.packb(head, use_bin_type=True), *frames])
    if out is not None:
        assert sum(a.nbytes for a in out.arrays) == sum(len(f) for f in frames)


def test_a_header_above_its_bound_is_refused_before_it_is_parsed():
    head = msgpack.packb(
        {"v": 1, "c": "x", "r": 0, "p": False, "b": {"pad": "x" * MAX_HEADER_BYTES}}
    )
    t0 = time.perf_counter()
    try:
        decode([head], 1 << 30)
        raise AssertionError("a header above the bound was accepted")
    except BadMessage as exc:
        assert "exceeds" in str(exc)
    assert time.perf_counter() - t0 < 0.1


def test_split_frames_must_be_full_frames():
    """An array over FRAME_MAX comes in full frames and a last one; anything else is refused
    (a peer cannot make the decoder join many small frames into one big array)."""
    n = FRAME_MAX + 8
    head = {"v": 1, "c": "x", "r": 0, "p": False, "b": {}, "a": [["uint8", [n]]]}
    packed = msgpack.packb(head)
    for parts in ([bytes(n - 8), bytes(8)], [bytes(8), bytes(n - 8)]):
        try:
            out = decode([packed, *parts], 1 << 30)
        except BadMessage as exc:
            assert parts[0] != bytes(n - 8) or "frames hold" in str(exc)
            continue
        assert len(parts[0]) == FRAME_MAX and out.arrays[0].nbytes == n


def test_no_elements_but_dimensions_whose_product_overflows():
    """Found by the atheris target: numpy refuses such a shape even with no elements."""
    head = {"v": 1, "c": "x", "r": 0, "p": False, "b": {}, "a": [["float32", [0, 2**62, 2**62]]]}
    try:
        decode([msgpack.packb(head), b""], 1 << 20)
        raise AssertionError("accepted")
    except BadMessage as exc:
        assert "shape" in str(exc)


# -- batches (hetps.cluster.batch): what a decoded BATCH message's body may hold --------------
batch_items = st.lists(
    st.one_of(
        *[
            st.tuples(
                st.sampled_from(["init", "push", "pull", "pull", "batch", "set_optimizer", ""]),
                st.one_of(st.integers(1, 2**40), st.integers(-2, 0), values),
                st.one_of(*[st.dictionaries(st.text(max_size=4), scalars, max_size=3)] * 2, values),
                st.one_of(st.just(0), st.integers(-2, 5), huge, values),
            ).map(list)
        ]
        * 3,
        values,
    ),
    max_size=6,
)


@FUZZ
@given(
    st.one_of(batch_items, values),
    st.one_of(
        st.just([]), st.lists(st.integers(0, 4).map(lambda n: np.ones(n, np.float32)), max_size=5)
    ),
)
def test_a_batch_unpacks_whole_or_is_refused(items, arrs):
    """Any body and arrays: either every item comes out (a batchable command, a positive
    request id, a map body, and array counts that add up to the arrays that came), or
    :class:`BadBatch` and nothing at all."""
    from hetps.cluster import batch
    from hetps.cluster import protocol as P

    msg = Message("batch", sender=9, body={"items": items}, arrays=arrs)
    try:
        out = batch.unpack(msg)
    except batch.BadBatch:
        return
    assert isinstance(items, list) and 0 < len(items) == len(out) <= P.MAX_BATCH_ITEMS
    assert sum(len(m.arrays) for m in out) == len(arrs)
    for item, m in zip(items, out, strict=True):
        assert m.cmd in P.BATCH_COMMANDS and m.req == item[1] > 0 and m.sender == 9
        assert isinstance(m.body, dict) and len(m.arrays) == item[3]


def test_too_many_items_are_refused_and_a_packed_batch_unpacks():
    from hetps.cluster import batch
    from hetps.cluster import protocol as P

    many = [["pull", i + 1, {}, 0] for i in range(P.MAX_BATCH_ITEMS + 1)]
    try:
        batch.unpack(Message("batch", body={"items": many}))
        raise AssertionError("a batch of too many items was unpacked")
    except batch.BadBatch as exc:
        assert "more than" in str(exc)
    reqs = [Message("push", req=i + 1, body={"k": i}, arrays=[np.ones(i)]) for i in range(3)]
    back = batch.unpack(_roundtrip(batch.pack(reqs)))
    assert [(m.cmd, m.req, m.body, [a.size for a in m.arrays]) for m in back] == [
        ("push", i + 1, {"k": i}, [i]) for i in range(3)
    ]


def _roundtrip(msg: Message) -> Message:
    return decode([bytes(memoryview(f)) for f in encode(msg)], BOUND)
