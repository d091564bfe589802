"""Per-link traffic counters of a van: bytes and messages each way, with timestamps."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class LinkStats:
    """Traffic on one link (this node <-> one peer), both directions."""

    bytes_sent: int = 0
    msgs_sent: int = 0
    bytes_recv: int = 0
    msgs_recv: int = 0
    first_send: float = 0.0
    last_send: float = 0.0
    first_recv: float = 0.0
    last_recv: float = 0.0


@dataclass
class LinkCounters:
    """Per-peer byte/message counters with timestamps; safe to read from any thread."""

    links: dict[int, LinkStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_send(self, peer: int, nbytes: int, now: float) -> None:
        """Count one message of ``nbytes`` sent to ``peer``."""
        with self.lock:
            st = self.links.setdefault(peer, LinkStats())
            st.bytes_sent += nbytes
            st.msgs_sent += 1
            st.first_send = st.first_send or now
            st.last_send = now

    def on_recv(self, peer: int, nbytes: int, now: float) -> None:
        """Count one message of ``nbytes`` received from ``peer``."""
        with self.lock:
            st = self.links.setdefault(peer, LinkStats())
            st.bytes_recv += nbytes
            st.msgs_recv += 1
            st.first_recv = st.first_recv or now
            st.last_recv = now

    def snapshot(self) -> dict[int, LinkStats]:
        """A copy of every link's counters."""
        with self.lock:
            return {k: LinkStats(**vars(v)) for k, v in self.links.items()}

    def totals(self) -> tuple[int, int]:
        """(bytes sent, bytes received) over all links."""
        with self.lock:
            return (
                sum(s.bytes_sent for s in self.links.values()),
                sum(s.bytes_recv for s in self.links.values()),
            )
