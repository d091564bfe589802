"""The planner's answer is decoded at the worker into its declared types
(:class:`hetps.balance.wire.Answer` and :class:`~hetps.balance.wire.Plan`): a plan of the
wrong shape, an unknown field or a body that is no answer comes out as one error naming
what is wrong (the agent raises it), never as a dict the agent would half use."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from hetps.balance.wire import pack_plan, reply_parts, unpack_plan
from hetps.transport.codec import Message

PLAN = {
    "epoch": 2,
    "assign": [0, 1, 1],
    "shares": [0.25, 0.75],
    "plan_s": 0.001,
    "kept": 0,
    "surprise": None,
    "recalibrations": 1,
}


def _answer(plan: dict, extras: dict | None = None, matrix: np.ndarray | None = None) -> dict:
    body, arrays = reply_parts(pack_plan(plan), extras, matrix)
    return unpack_plan(Message("balance_report", body=body, arrays=arrays))


def test_a_plan_decodes_to_its_fields_and_rank_0s_extras():
    assert _answer(PLAN) == PLAN
    asked = _answer({**PLAN, "recalibrate": True, "spread": [1, 0, [1, 2]]})
    assert asked == {**PLAN, "recalibrate": True, "spread": [1, 0, [1, 2]]}
    rates = {"up": [1.0, None], "down": [2.0, None]}
    matrix = np.array([[np.inf, 3.0], [4.0, np.inf]])
    got = _answer(PLAN, {"node_rates": rates}, matrix)
    assert got == {**PLAN, "node_rates": rates, "link_matrix": [[None, 3.0], [4.0, None]]}


@pytest.mark.parametrize(
    ("plan", "says"),
    [
        ({**PLAN, "assign": ["0", 1, 1]}, "Expected `int`, got `str` - at `$.assign[0]`"),
        ({**PLAN, "epoch": None}, "Expected `int`, got `None` - at `$.epoch`"),
        ({k: v for k, v in PLAN.items() if k != "assign"}, "missing required field `assign`"),
        ({**PLAN, "moves": []}, "unknown field `moves`"),
        ({**PLAN, "recalibrate": "yes"}, "Expected `bool`, got `str` - at `$.recalibrate`"),
    ],
)
def test_a_plan_of_the_wrong_shape_is_one_error(plan, says):
    got = _answer(plan)
    assert list(got) == ["error"], got
    assert got["error"].startswith("unreadable plan: ") and says in got["error"], got


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"plan": "not bytes"}, "unreadable plan: Expected `bytes`, got `str` - at `$.plan`"),
        ({"plan": msgpack.packb([1, 2])}, "unreadable plan: Expected `object`, got `array`"),
        ({"plan": pack_plan(PLAN), "rates": {}}, "unreadable plan: Object contains unknown field"),
        ({}, "an answer of no plan"),
        ({"error": "rebalance() before any kv.init()"}, "rebalance() before any kv.init()"),
    ],
)
def test_an_answer_that_is_no_plan_is_one_error(body, says):
    got = unpack_plan(Message("balance_report", body=body))
    assert list(got) == ["error"] and says in got["error"], got
