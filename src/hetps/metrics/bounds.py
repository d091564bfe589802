"""A metrics report's bounds and types, each part declared once as a msgspec struct and
decoded once (:func:`decode`): a report the scheduler refuses raises :class:`ReportError`,
whose message names the field that is wrong (the worker's and server's reports,
:mod:`hetps.metrics.reports` and :mod:`hetps.metrics.server_meter`; the machine's part of
them, :class:`Sys` and ``log``, :mod:`hetps.metrics.sysinfo`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

MAX_COUNT = 1 << 53  # exact in a float, as Prometheus reads it
MAX_SECONDS, MAX_T = 1e12, 1e10
#: lines a node keeps (and a report carries) at most, and the longest line
LOG_KEEP, LOG_WIDTH = 20, 300
#: GPUs a report lists at most
MAX_GPUS = 16

Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
#: a time on a node's own clock, or a unix time
Time = Annotated[float, Meta(ge=0, le=MAX_T)]
#: [peer rank, bytes sent, bytes received] (the rank's bound is the job's: :func:`links`)
Link = tuple[Count, Count, Count]
Text200 = Annotated[str, Meta(max_length=200)]

T = TypeVar("T")


class ReportError(ValueError):
    """A metrics report the scheduler refuses; the message says what is wrong with it."""


class Sys(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A node's machine: CPU (percent of one core), resident bytes, GPUs ``[utilisation %,
    memory used, memory total]`` or why none."""

    cpu: Annotated[float, Meta(ge=0, le=1e5)] | None = None
    rss: Count | None = None
    gpu: Annotated[
        list[tuple[Annotated[int, Meta(ge=0, le=100)], Count, Count]], Meta(max_length=MAX_GPUS)
    ] = []
    nogpu: Text200 | None = None


class Report(msgspec.Struct, kw_only=True):
    """What a worker's and a server's report both carry (unknown fields are left alone)."""

    seq: Annotated[int, Meta(ge=1, le=MAX_COUNT)]
    t: Time
    links: list[Link] = []
    sys: Sys | None = None
    log: Annotated[list[Annotated[str, Meta(max_length=LOG_WIDTH)]], Meta(max_length=LOG_KEEP)] = []


def names(peer: str, count: int) -> dict[str, str]:
    """What a refusal calls each part of :class:`Report`, by its path (``[]``: any index)."""
    return {
        "$.links": f"'links' (a list of at most {count} rows, one per {peer})",
        "$.links[]": f"a 'links' row [{peer} rank, sent, received]",
        "$.links[][0]": f"a link's {peer} rank",
        "$.links[][1]": "a link's bytes sent",
        "$.links[][2]": "a link's bytes received",
        "$.sys": "'sys' must be a map of cpu, rss, gpu, nogpu",
        "$.sys.cpu": "'sys.cpu' (percent)",
        "$.sys.rss": "'sys.rss' (bytes)",
        "$.sys.gpu": f"'sys.gpu' must be a list of at most {MAX_GPUS} GPUs",
        "$.sys.gpu[]": "a GPU [utilisation, used, total]",
        "$.sys.gpu[][0]": "a GPU's utilisation",
        "$.sys.gpu[][1]": "a GPU's memory used",
        "$.sys.gpu[][2]": "a GPU's memory",
        "$.sys.nogpu": "'sys.nogpu' must be a printable text of up to 200 characters",
        "$.log": f"'log' must be a list of at most {LOG_KEEP} lines",
        "$.log[]": f"a 'log' line must be a printable text of up to {LOG_WIDTH} characters",
    }


_AT = re.compile(r" - at `(?:key` in `)?(\$[^`]*)`$")
_MISSING = re.compile(r"missing required field `(\w+)`")


def decode(body: Any, kind: type[T], named: dict[str, str]) -> T:
    """``body`` as a ``kind``; else :class:`ReportError` naming the field (``named``: what a
    path is called; any other path is named as it is)."""
    if not isinstance(body, dict):
        raise ReportError("the body is not a map")
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = _AT.search(text)
        problem, path = (text[: at.start()], at.group(1)) if at else (text, "$")
        missing = _MISSING.search(problem)
        if missing:
            path += "." + missing.group(1)
        # a names() key as a pattern of paths: [] stands for any index or map key
        keys = ((re.escape(k).replace(r"\[\]", r"\[[^\]]*\]"), w) for k, w in named.items())
        what = next((w for k, w in keys if re.fullmatch(k, path)), repr(path[2:]))
        raise ReportError(f"{what}: {problem}") from None


def links(rows: list[Link], count: int, peer: str, what: str = "") -> dict[int, tuple[int, int]]:
    """Link rows checked against the job: at most one per ``peer`` (``count`` of them), each
    rank below ``count``; ``what`` names the rows' place in a refusal."""
    if len(rows) > count:
        raise ReportError(f"{what}'links' must be a list of at most {count} rows (one per {peer})")
    out: dict[int, tuple[int, int]] = {}
    for rank, sent, recv in rows:
        if rank >= count:
            raise ReportError(f"{what}a link's {peer} rank must be below {count}, not {rank}")
        if rank in out:
            raise ReportError(f"{what}'links' lists {peer} {rank} twice")
        out[rank] = (sent, recv)
    return out


def printable(text: str | None, what: str) -> None:
    """Raise :class:`ReportError` (``what`` says what the text must be) unless ``text`` is
    None or printable."""
    if text is not None and not text.isprintable():
        raise ReportError(what)
