"""The planner's answer on the wire (the reply to ``balance_report``), both ends.

Every worker gets the same plan (epoch, the slices' servers, the shares, the planner's
counters, a spread or re-calibration request). The scheduler packs it once per round
(:func:`pack_plan`, msgpack bytes) and every reply carries those bytes as its ``plan`` field,
so the work per worker is a copy, not an encoding. Worker rank 0 alone also gets what reports
and plots read: ``node_rates`` (body) and the estimated link matrix (the reply's one array,
float64 N x N, ``inf`` on the diagonal): an N x N matrix to every worker was 9.5 MB per worker
at N=1,024, over the codec's 1 MiB header bound (docs/PERFORMANCE.md, "Scale (simulated)").
:func:`unpack_plan` gives the worker the plan as one dict, the matrix as lists (``None`` for
what is not finite), as before. An error answer is a plain ``{"error": text}``.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from hetps.transport.codec import Message

__all__ = ["pack_plan", "reply_parts", "unpack_plan"]


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


def _listed_matrix(m: np.ndarray) -> list[list[float | None]]:
    return [[x if math.isfinite(x) else None for x in row] for row in m.tolist()]


def unpack_plan(msg: Message) -> dict:
    """The planner's answer in ``msg`` as one dict (``{"error": ...}`` when it is one or
    cannot be read)."""
    body = msg.body
    packed = body.get("plan")
    if not isinstance(packed, bytes):
        return dict(body)  # an error answer
    try:
        plan = msgpack.unpackb(packed, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds
        return {"error": f"unreadable plan: {exc}"}
    if not isinstance(plan, dict):
        return {"error": "unreadable plan: not a map"}
    plan.update((k, v) for k, v in body.items() if k != "plan")
    if msg.arrays:
        m = np.asarray(msg.arrays[0], dtype=float)
        if m.ndim == 2:
            plan["link_matrix"] = _listed_matrix(m)
    return plan
