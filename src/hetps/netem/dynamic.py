"""``DynamicDriver``: re-applies a dynamic scenario's rates to a running emulator every period."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hetps.netem.scenario import Scenario

__all__ = ["DynamicDriver"]

log = logging.getLogger("hetps.netem")


class Shaped(Protocol):
    """What the driver needs of an emulator (:class:`~hetps.netem.emulator.Netem`)."""

    scenario: Scenario

    @property
    def closed(self) -> bool: ...

    def set_rates(self, rates_mbit: Sequence[float], *, epoch: int | None = None) -> None: ...


class DynamicDriver:
    """Re-applies the scenario's rates every ``period_s`` in a background thread.

    Epoch ``k`` starts ``k * period_s`` after :meth:`start` (anchored, so no drift); waits use
    ``Event.wait(timeout)`` and :meth:`stop` wakes the thread at once.

    Args:
        netem: a started :class:`Netem`.
        scenario: defaults to ``netem.scenario``; must be dynamic.
        on_change: called as ``on_change(epoch, rates)`` after every change (driver thread).
        start_epoch: the epoch already applied.
        period_s: override the scenario's period (e.g. short periods in tests).
    """

    def __init__(
        self,
        netem: Shaped,
        scenario: Scenario | None = None,
        *,
        on_change: Callable[[int, list[float]], None] | None = None,
        start_epoch: int = 0,
        period_s: float | None = None,
    ) -> None:
        self.netem = netem
        self.scenario = scenario or netem.scenario
        period = period_s if period_s is not None else self.scenario.period_s
        if period is None or not period > 0:
            raise ValueError("DynamicDriver needs a dynamic scenario (period_s > 0)")
        self.period_s = float(period)
        self.on_change = on_change
        self.epoch = start_epoch
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DynamicDriver:
        """Start the thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("DynamicDriver already started")
        self._thread = threading.Thread(target=self._loop, name="hetps-netem-dynamic", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop and join it (bounded by ``timeout``)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def __enter__(self) -> DynamicDriver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        t0 = time.monotonic()
        first = self.epoch
        while True:
            due = t0 + (self.epoch + 1 - first) * self.period_s
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            epoch = self.epoch + 1
            rates = self.scenario.rates_at(epoch)
            try:
                self.netem.set_rates(rates, epoch=epoch)
            except BaseException as e:  # noqa: BLE001 - reported through .error
                if self._stop.is_set() or self.netem.closed:
                    return
                self.error = e
                log.error("netem: dynamic rate change failed: %s", e)
                return
            self.epoch = epoch
            if self.on_change is not None:
                try:
                    self.on_change(epoch, rates)
                except Exception:  # noqa: BLE001
                    log.exception("netem: on_change callback failed")
