"""Log lines for refused reports, a few per window: a node that sends bad reports on end
cannot fill the scheduler's log (the others are counted and said in one line)."""

from __future__ import annotations

import logging
import threading
import time

#: lines logged one by one per window, and the window (seconds)
BURST = 5
WINDOW_S = 10.0


class QuietLog:
    """At most :data:`BURST` lines per :data:`WINDOW_S` on ``logger``; the rest counted and
    said in one line when the window ends (at the next refusal)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.log = logger
        self.what = what
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._logged = 0
        self._quiet = 0

    def warning(self, text: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= WINDOW_S:
                if self._quiet:
                    self.log.warning(
                        "%d more %s refused in the last %.0f s (not logged one by one)",
                        self._quiet,
                        self.what,
                        now - self._start,
                    )
                self._start, self._logged, self._quiet = now, 0, 0
            if self._logged < BURST:
                self._logged += 1
                self.log.warning(text, *args)
            else:
                self._quiet += 1
