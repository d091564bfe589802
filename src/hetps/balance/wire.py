"""The planner's answer on the wire (the reply to ``balance_report``), both ends.
(docs/MODULES.md, "hetps.balance.wire")"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from hetps.cluster.commands import BalanceAnswer as Answer
from hetps.transport.codec import Message

__all__ = ["Answer", "Plan", "pack_plan", "reply_parts", "unpack_plan"]


class Plan(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The plan every worker gets (:meth:`hetps.balance.service.Planner.plan`, packed once;
    docs/BALANCE.md, "The answer", says what each field means)."""

    epoch: int
    assign: list[int]
    shares: list[float]
    plan_s: float
    kept: int
    surprise: float | None = None
    recalibrations: int
    recalibrate: bool | UnsetType = UNSET
    spread: list[Any] | UnsetType = UNSET


def pack_plan(plan: dict) -> bytes:
    """The part of the answer that every worker gets, encoded once."""
    return msgpack.packb(plan, use_bin_type=True)


def reply_parts(
    packed: bytes, extras: dict | None = None, matrix: np.ndarray | None = None
) -> tuple[dict, list[np.ndarray]]:
    """Body and arrays of one worker's answer: the packed plan, and for rank 0 the report
    fields (``extras``) and the link matrix."""
    body: dict[str, Any] = {"plan": packed}
    if extras:
        body.update(extras)
    arrays = [] if matrix is None else [np.ascontiguousarray(matrix, dtype=np.float64)]
    return body, arrays


def unpack_plan(msg: Message) -> dict:
    """The planner's answer in ``msg``, decoded into its declared types (:class:`Answer`,
    :class:`Plan`), as one dict of the plan's fields that are set, with rank 0's report
    fields; ``{"error": ...}`` when it is an error answer or does not fit those types."""
    if msg.error is not None:
        return {"error": msg.error}
    try:  # (decoded by the node's dispatch; a host leader's relay is decoded here)
        answer = (
            msg.typed
            if isinstance(msg.typed, Answer)
            else msgspec.convert(msg.body, Answer, builtin_types=(bytes,))
        )
        if answer.plan is UNSET:
            return {"error": "an answer of no plan"}
        plan = msgspec.to_builtins(msgspec.msgpack.decode(answer.plan, type=Plan))
    except msgspec.MsgspecError as exc:
        return {"error": f"unreadable plan: {exc}"}
    if answer.node_rates is not UNSET:
        plan["node_rates"] = answer.node_rates
    if msg.arrays:
        m = np.asarray(msg.arrays[0], dtype=float)
        if m.ndim == 2:
            plan["link_matrix"] = [[x if math.isfinite(x) else None for x in r] for r in m.tolist()]
    return plan
