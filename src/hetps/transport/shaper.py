"""An in-process token-bucket limiter for a node's sending rate (``HETPS_SHAPE_MBIT``).
(docs/MODULES.md, "hetps.transport.shaper")"""

from __future__ import annotations

import threading
import time


class TokenBucket:
    """Limit to ``rate_bytes_per_s`` with bursts of at most ``burst_bytes``."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float | None = None) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError("the shaping rate must be > 0")
        self.rate = float(rate_bytes_per_s)
        # a small default burst (5 ms of traffic, at least 8 KiB), like a tc TBF bucket: with
        # a large one, a message after an idle spell (a probe) leaves at memory speed and
        # reads as a fast link
        self.burst = float(
            burst_bytes if burst_bytes is not None else max(8 * 1024, self.rate / 200)
        )
        self.tokens = self.burst
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def delay_for(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` of tokens (going into debt if needed); seconds the caller must wait."""
        with self.lock:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= nbytes
            return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def acquire(self, nbytes: int) -> float:
        """Block until ``nbytes`` may be sent; returns the seconds waited."""
        wait = self.delay_for(nbytes, time.monotonic())
        if wait > 0:
            time.sleep(wait)  # this *is* the emulated link: time spent on the wire
        return wait
