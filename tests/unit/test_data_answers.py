"""A server's answer to a push, a pull or a probe is read as its declared type
(:class:`hetps.cluster.bodies.DataAnswer`), once; a batch is read as its declared type
(:class:`hetps.cluster.commands.Batch`): what is not one comes out as one error naming the
field, or (an answer's own fields) as nothing measured and every worker summed."""

from __future__ import annotations

import numpy as np
import pytest

from hetps.cluster import batch, bodies
from hetps.cluster import protocol as P
from hetps.kvstore.keys import land_into
from hetps.transport.codec import Message


def test_a_data_answer_is_decoded_once_and_a_bad_one_reads_as_empty():
    good = Message(P.PULL, req=1, reply=True, body={"meas": [1.0, 2.0, 4096], "w": 2})
    got = bodies.answer(good)
    assert (got.meas, got.workers) == ([1.0, 2.0, 4096.0], 2)
    assert bodies.answer(good) is got  # kept on the message: not decoded again
    for body in ({"w": True}, {"w": 0}, {"meas": [1.0, 2.0]}, {"meas": [1, 2, "x"]}, {"x": 1}):
        bad = bodies.answer(Message(P.PULL, req=1, reply=True, body=body))
        assert (bad.meas, bad.workers) == (None, None), body


def test_a_pull_answer_marks_a_short_sum_only_when_it_says_so():
    dest, short = np.zeros(4, np.float32), {}
    land = land_into("k", dest, 0, 4, short)
    land(Message(P.PULL, reply=True, body={"w": 2}, arrays=[np.ones(4, np.float32)]))
    assert short == {"k": {(0, 4): 2}} and (dest == 1).all()
    land(Message(P.PULL, reply=True, body={"w": "2"}, arrays=[np.full(4, 3, np.float32)]))
    assert short == {"k": {}} and (dest == 3).all()


def test_a_batch_is_its_declared_type_or_one_error_naming_the_field():
    items = [["push", 1, {"k": 1}, 1], ["pull", 2, {}, 0]]
    assert batch.layout({"items": items}, 1) == [("push", 1, {"k": 1}, 1), ("pull", 2, {}, 0)]
    for body, total, says in [
        ({"items": []}, 0, "field 'items' (["),
        ({"items": [["push", 1, [], 0]]}, 0, "expected `object`, got `array` at items[0][2]"),
        ({"items": [["push", 0, {}, 0]]}, 0, "expected `int` >= 1 at items[0][1]"),
        ({"items": [["set_states", 1, {}, 0]]}, 0, "invalid enum value 'set_states'"),
        ({"items": [["pull", 1, {}, 0]] * 1025}, 0, "more than 1024 entries"),
        ({"items": [["push", 1, {}, 2]]}, 1, "the items take 2 arrays but the batch carries 1"),
        (5, 0, "the body must be a map"),
    ]:
        with pytest.raises(batch.BadBatch) as exc:
            batch.layout(body, total)
        assert says in str(exc.value), (body, str(exc.value))
