"""Where each key lives: whole on one server, or split over all (MXNet's big-array rule).
(docs/MODULES.md, "hetps.kvstore.placement")"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from hetps.cluster.bodies import chunk_elems  # noqa: F401 (the stores name it here)

Key = int | str


def key_hash(key: Key) -> int:
    """Deterministic 32-bit hash of an int or str key (CRC-32 of a typed text form)."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"a key must be an int or a str, got {type(key).__name__} {key!r}")
    text = f"i:{key}" if isinstance(key, int) else f"s:{key}"
    return zlib.crc32(text.encode("utf-8"))


def server_of(key: Key, num_servers: int) -> int:
    """Rank of the server that holds the whole of a small key."""
    if num_servers < 1:
        raise ValueError("num_servers must be >= 1")
    return key_hash(key) % num_servers


@dataclass(frozen=True)
class Part:
    """A contiguous range ``[start, stop)`` of a flattened key, held by server ``server``.

    ``index`` names the part on that server (0 for a whole key, the part number otherwise).
    """

    server: int
    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of elements in the part."""
        return self.stop - self.start


def parts_of(key: Key, size: int, num_servers: int, bigarray_bound: int) -> list[Part]:
    """The parts of a key of ``size`` elements."""
    if size < 0:
        raise ValueError("size must be >= 0")
    if size < bigarray_bound or num_servers == 1:
        return [Part(server_of(key, num_servers), 0, 0, size)]
    bounds = [i * size // num_servers for i in range(num_servers + 1)]
    return [Part(i, i, bounds[i], bounds[i + 1]) for i in range(num_servers)]


def chunks(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into ranges of at most ``step`` (one empty range if empty)."""
    if stop <= start:
        return [(start, start)]
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]
