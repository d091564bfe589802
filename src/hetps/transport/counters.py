"""Per-link traffic counters of a van: bytes and messages each way."""

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


@dataclass
class LinkCounters:
    """Per-peer byte/message counters; safe to read from any thread."""

    links: dict[int, LinkStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, peer: int, nbytes: int, sent: bool) -> None:
        """Count one message of ``nbytes`` sent to (or received from) ``peer``."""
        with self.lock:
            st = self.links.get(peer)
            if st is None:  # (not setdefault: it would make a LinkStats every message)
                st = self.links[peer] = LinkStats()
            if sent:
                st.bytes_sent += nbytes
                st.msgs_sent += 1
            else:
                st.bytes_recv += nbytes
                st.msgs_recv += 1

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
