"""A coverage-guided fuzz target for the codec's decoder (atheris/libFuzzer), run by hand.

    pip install atheris          # not a test dependency
    PYTHONPATH=src python tests/security/atheris_decoder.py -max_total_time=300 [CORPUS_DIR]

The input chooses a header (mostly well formed, with fields of wrong types, array
declarations with huge lengths, sometimes raw bytes) and up to 7 array frames (sometimes one
too few or too many, of any size); the decoder must return a message whose arrays hold exactly the bytes of its frames, or raise BadMessage, in
bounded time and memory. Any other exception (or a failed check) is a crash: libFuzzer stops and writes the input to ``crash-*``; replay it with
``python tests/security/atheris_decoder.py crash-<hash>``. ``-rss_limit_mb=512`` (the default
is 2048) makes a decode that allocates with a declared length fail as a crash too.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    import msgpack

    from hetps.transport import codec

BOUND = 1 << 22


DTYPES = [*sorted(codec.WIRE_DTYPES), "complex64", ""]


def _value(fdp: atheris.FuzzedDataProvider):
    """Any msgpack value, of any type: what a hostile header puts in a field."""
    kind = fdp.ConsumeIntInRange(0, 6)
    if kind == 0:
        return fdp.ConsumeInt(9)
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeUnicodeNoSurrogates(8)
    if kind == 3:
        return fdp.ConsumeBytes(8)
    if kind == 4:
        return fdp.ConsumeRegularFloat()
    if kind == 5:
        return [fdp.ConsumeIntInRange(0, 9) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    return None


def frames_of(data: bytes) -> list[bytes]:
    """A header frame and up to 7 array frames. Mostly a header of the right shape whose
    fields, array declarations and frame sizes the input chooses (a structure-aware fuzzer
    gets past the first checks); sometimes raw header bytes."""
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeIntInRange(0, 7) == 0:
        n = fdp.ConsumeIntInRange(0, 7)
        arrays = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256)) for _ in range(n)]
        return [fdp.ConsumeBytes(fdp.remaining_bytes()), *arrays]
    specs = []
    frames = []
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        dtype = DTYPES[fdp.ConsumeIntInRange(0, len(DTYPES) - 1)]
        shape = [fdp.ConsumeIntInRange(0, 16) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        if fdp.ConsumeIntInRange(0, 15) == 0:
            shape.append(fdp.ConsumeInt(8))  # a huge (or negative) declared length
        specs.append([dtype, shape] if fdp.ConsumeIntInRange(0, 15) else _value(fdp))
    for _ in range(len(specs) + fdp.ConsumeIntInRange(-1, 1)):  # sometimes one too few/many
        frames.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256)))
    head = {
        "v": 1,
        "c": fdp.ConsumeUnicodeNoSurrogates(6) or "push",
        "r": fdp.ConsumeIntInRange(0, 1 << 20),
        "p": fdp.ConsumeBool(),
        "o": fdp.ConsumeIntInRange(-3, 3),
        "t": 0.0,
        "b": {},
        "a": specs,
    }
    for _ in range(fdp.ConsumeIntInRange(0, 2)):  # a field of the wrong type
        head[["v", "c", "r", "p", "o", "t", "b", "a", "m"][fdp.ConsumeIntInRange(0, 8)]] = _value(
            fdp
        )
    try:
        packed = msgpack.packb(head, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return []
    return [packed, *frames]


def test_one_input(data: bytes) -> None:
    frames = frames_of(data)
    try:
        msg = codec.decode(frames, BOUND)
    except codec.BadMessage:
        return
    # what was decoded is exactly what came: no frame ignored, none read twice
    assert sum(a.nbytes for a in msg.arrays) == sum(len(f) for f in frames[1:])
    assert isinstance(msg.body, dict) and isinstance(msg.cmd, str)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
