"""Change detection: has the network changed under the plan? (pure: no messages, no clock)
(docs/MODULES.md, "hetps.balance.surprise")"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

log = logging.getLogger("hetps.planner")

#: a round this many times slower (against the plan's prediction) than the recent median
#: means the network changed under the plan: every worker probes a whole cycle anew
SURPRISE = 1.5
SURPRISE_HISTORY = 8  # rounds of (measured / predicted) kept for the median
SURPRISE_MIN_HISTORY = 3  # rounds needed before a round can surprise
SURPRISE_SETTLE = 2  # rounds after a plan change or a cycle that are not judged
RECAL_WAIT = 4  # rounds a requested cycle may take to come back before it counts as lost
SURPRISE_ROUNDS = 2  # surprising rounds in a row that it takes (one is a hiccup)
SURPRISE_AT_ONCE = 2.0  # ... unless one round is this much slower
SURPRISE_IN_SETTLE = 4.0  # a round right after a plan change this much slower surprises too

Prediction = Callable[[], "float | None"]


class SurpriseDetector:
    """Judges each round's communication spans against the plan's predicted time."""

    def __init__(self) -> None:
        self._ratios: list[float] = []  # recent (measured / predicted) of usual rounds
        self._surprises = 0  # surprising rounds in a row
        self._settle = 0  # rounds left that carry a migration or a new cycle
        self._rebase = False  # the first judged round after a cycle may set a new baseline
        self._recal_asked: int | None = None  # the round that asked, while it is pending
        self._recal_wait = 0  # released rounds left before a pending request counts as lost
        self.last_surprise: float | None = None

    @property
    def settling(self) -> bool:
        """Whether the current rounds carry a migration or a new cycle (not judged)."""
        return self._settle > 0

    def plan_changed(self) -> None:
        """A new assignment was adopted: its first rounds carry the migration."""
        self._settle = SURPRISE_SETTLE

    def cycle_arrived(self) -> None:
        """A new cycle of probes is in: the request is answered, and its rounds settle."""
        self._recal_asked = None
        self._surprises = 0
        self._settle = SURPRISE_SETTLE
        self._rebase = True

    def judge(
        self,
        rnd: int,
        spans: list[float],
        contradicted: bool,
        predicted: Prediction,
        before: Prediction,
    ) -> bool:
        """Whether round ``rnd`` says the network changed, so that every worker should
        probe a whole cycle anew:

        - ``contradicted``: one of the round's capacity probes read far off what the caps
          say its link carries (which node changed, only a new cycle can tell);
        - the round took far longer than predicted (:meth:`_slow_round`).

        ``predicted()`` is the current assignment's predicted time, ``before()`` the one
        before the last plan change (None: cannot be predicted). Not judged while a
        re-calibration is on its way."""
        if self._recal_asked is not None:
            self._recal_wait -= 1
            if self._recal_wait >= 0:  # its cycle has not come back yet
                return False
            # lost (a worker finished, or the workers do not probe): judge afresh
            self._recal_asked, self._surprises = None, 0
        slow = self._slow_round(spans, predicted, before)
        if not (slow or contradicted):
            return False
        self._recal_asked, self._recal_wait = rnd, RECAL_WAIT
        log.info(
            "planner: %s in round %d; asking for a new probe cycle",
            "a probe far off its link's caps" if contradicted else "a round far too slow",
            rnd,
        )
        return True

    def _slow_round(
        self, spans: list[float], predicted_fn: Prediction, before_fn: Prediction
    ) -> bool:
        """Whether this round (and the one before) took far longer than predicted.
        (docs/MODULES.md, "hetps.balance.surprise")"""
        if not spans:
            return False
        settling = self._settle > 0
        if settling:
            self._settle -= 1
            if self._rebase:  # after a cycle: its own first judged round decides (below)
                return False
        predicted = predicted_fn()
        if not predicted or not np.isfinite(predicted) or predicted <= 0:
            return False
        ratio = float(np.median(spans)) / predicted
        recent = self._ratios
        if settling:
            # a migration's rounds are not judged, unless one is so slow that no migration
            # explains it: a cut that came with a plan change (made from the slow round
            # itself) would otherwise go unseen for SURPRISE_SETTLE more rounds. With
            # pipelined answers the first of them may still have run the assignment before
            # the change: judged against the slower of the two predictions
            before = before_fn()
            if before and np.isfinite(before) and before > predicted:
                ratio = float(np.median(spans)) / before
            if len(recent) >= SURPRISE_MIN_HISTORY:
                self.last_surprise = ratio / float(np.median(recent))
                if self.last_surprise > SURPRISE_IN_SETTLE:
                    self._surprises = 0
                    return True
            return False
        rebase, self._rebase = self._rebase, False
        if len(recent) >= SURPRISE_MIN_HISTORY:
            self.last_surprise = ratio / float(np.median(recent))
            if rebase and self.last_surprise > SURPRISE:
                # a fresh cycle did not bring the rounds back to what was usual: what the
                # caps cannot show (delay, loss, a slow worker's compute in the spans) is
                # the new usual, not a reason to probe again and again
                recent[:] = [ratio]
                self._surprises = 0
                return False
            self._surprises = self._surprises + 1 if self.last_surprise > SURPRISE else 0
            if self._surprises >= SURPRISE_ROUNDS or self.last_surprise > SURPRISE_AT_ONCE:
                self._surprises = 0
                return True
            if self._surprises:  # not (yet) part of what is usual
                return False
        recent.append(ratio)
        del recent[:-SURPRISE_HISTORY]
        return False
