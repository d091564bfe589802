"""A server's side of link measurement (network-aware balancing, docs/BALANCE.md): it pairs
a data message with the forecast its sender sent just before it, and the sample (when the
forecast came, when the data was whole, how many bytes) travels back in the answer, where
the worker's agent reads it. Probes are answered here too."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hetps.cluster import protocol as P
from hetps.cluster.node import Node
from hetps.transport.codec import Message

#: forecasts kept at most (a peer that forecasts and never sends)
MAX_FORECASTS = 65536


class LinkMeter:
    """Forecasts received and samples not yet answered, per sender."""

    def __init__(self, node: Node) -> None:
        self.node = node
        # (sender, tag) -> (arrival time, whether the receive thread was behind then)
        self.forecasts: dict[tuple[int, Any], tuple[float, bool]] = {}
        self.samples: dict[tuple[int, int], list[float]] = {}  # (sender, req) -> [t0, t1, bytes]

    def forecast(self, msg: Message) -> None:
        """A data message is on its way: note when this came."""
        self.forecasts[(msg.sender, msg.typed.tag)] = (time.time(), msg.backlogged)
        if len(self.forecasts) > MAX_FORECASTS:
            self.forecasts.clear()

    def measure(self, msg: Message) -> None:
        """Pair a data message with its forecast: the link sample travels back in the ack."""
        fc = self.forecasts.pop((msg.sender, msg.typed.tag), None)
        if fc is None:
            return
        t0, late = fc
        t1 = time.time()
        if msg.mark is not None:  # its arrays came on a bulk channel: timed from their mark
            t0, late, t1 = msg.mark  # (to when it was whole, by the same thread's clock)
        if late and msg.cmd == P.PROBE and not msg.typed.spread:
            # the forecast was taken from a queue: its stamp is late, so the gap (and the
            # rate) would be read too fast; a probe is kept only when timed on time (data
            # samples, many per round, go on: the planner takes their median and busy time;
            # so do a spread probe's flows, which arrive together: the planner spans them
            # from the earliest forecast, and a late stamp only shortens one flow's span)
            return
        meas = [t0, t1, float(msg.nbytes)]
        if msg.cmd == P.PROBE and msg.typed.spread:
            meas.append(1.0 if late else 0.0)  # the planner drops a spread whose first was late
        self.samples[(msg.sender, msg.req)] = meas

    def measured(self, msg: Message) -> bool:
        """Whether ``msg``'s sample is taken (a push handled again from the backlog)."""
        return (msg.sender, msg.req) in self.samples

    def take(self, msg: Message) -> list[float] | None:
        """``msg``'s sample, for its answer (None if it has none)."""
        return self.samples.pop((msg.sender, msg.req), None)

    def forecast_to(self, msg: Message) -> None:
        """Tell ``msg``'s sender an answer is coming, so it can time it (best effort)."""
        self.node.send(msg.sender, Message(P.FORECAST, body={"tag": msg.req}))

    def probe(self, msg: Message, answers: Any) -> None:
        """Answer a probe: its push side is measured here, the reply is measured by the worker."""
        self.measure(msg)
        size = msg.typed.reply_bytes  # (at most 64 MiB: its declared bound)
        if size:
            self.forecast_to(msg)
        meas = self.take(msg)
        answers.reply(
            msg, {"meas": meas} if meas else {}, arrays=[np.zeros(size, np.uint8)], timed=bool(size)
        )

    def forget(self, worker: int) -> None:
        """A worker left: drop what it measured."""
        for table in (self.samples, self.forecasts):
            for k in [k for k in table if k[0] == worker]:
                del table[k]
