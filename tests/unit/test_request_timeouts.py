"""A list call that times out gives up every request it was still waiting for: none of them
stays pending (to be answered, and written into the caller's arrays, after the caller has
its error), and each ends with the timeout."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.cluster.errors import RequestTimeout
from hetps.cluster.requests import RequestTracker, wait_all


def test_a_timed_out_call_gives_up_all_its_requests():
    tracker = RequestTracker()
    answered, late, never = (tracker.new(peer=3, what=f"pull {i}") for i in range(3))
    for f in (answered, late, never):
        f.landing = np.zeros(4, np.float32)
    assert tracker.resolve(answered.req, "value", sender=3)
    with pytest.raises(RequestTimeout):
        wait_all([answered, late, never], 0.05, "pull")
    assert tracker.pending() == 0
    for f in (late, never):
        assert f.done()
        with pytest.raises(RequestTimeout):
            f.wait(0)
    # an answer that comes after the call gave up finds nobody to deliver to
    assert not tracker.resolve(never.req, "late value", sender=3)
    assert tracker.landing_of(never.req, 3) is None
