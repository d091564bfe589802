"""The trace-event format's checker (Chrome's Trace Event Format, the JSON Object and Array
Formats), run over every trace the tests write: :func:`validate_trace` lists every problem;
:func:`counter_totals` sums a trace's counter tracks."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: the phases of the trace event format
_KNOWN_PH = set("BEXiIbneCMsftPONDRcv") | {"(", ")"}
_META_NAMES = {
    "process_name": ("name", str),
    "process_labels": ("labels", str),
    "process_sort_index": ("sort_index", int),
    "thread_name": ("name", str),
    "thread_sort_index": ("sort_index", int),
}


class TraceFormatError(ValueError):
    """A trace object breaks the trace event format; ``problems`` lists every finding."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"not a valid trace: {problems[0]}{more}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_trace(trace: Any) -> None:
    """Check ``trace`` against the Trace Event Format (JSON Object or Array Format); raise
    :class:`TraceFormatError` listing every problem.

    Checked: the container (``traceEvents`` a list; ``displayTimeUnit`` ``"ms"`` or ``"ns"``);
    every event an object with a known ``ph``; ``name`` a string (every phase but ``E``);
    ``pid``/``tid`` integers; ``ts`` a finite number >= 0 (optional for ``M``); ``cat`` a
    string and ``args`` an object where present; ``X``: ``dur`` a finite number >= 0, and the
    ``X`` slices of one thread nest (none starts inside another and ends after it); ``B``/``E``:
    each ``E`` closes the thread's last open ``B`` (same name when it has one), none is left
    open, time never goes back within a thread; ``C``: ``args`` holds numbers only; ``M``: a
    known metadata name whose ``args`` has the right key and type (``name``/``labels`` a
    string, ``sort_index`` an integer); ``i``/``I``: scope ``s`` in g, p, t.
    """
    problems: list[str] = []
    if isinstance(trace, list):
        events = trace
    elif isinstance(trace, dict):
        if "traceEvents" not in trace:
            raise TraceFormatError(["the object has no traceEvents list"])
        events = trace["traceEvents"]
        if not isinstance(events, list):
            raise TraceFormatError(["traceEvents is not a list"])
        unit = trace.get("displayTimeUnit", "ms")
        if unit not in ("ms", "ns"):
            problems.append(f"displayTimeUnit must be 'ms' or 'ns', got {unit!r}")
    else:
        raise TraceFormatError([f"a trace is a JSON object or array, got {type(trace).__name__}"])

    open_b: dict[tuple[Any, Any], list[tuple[str | None, float]]] = {}
    last_ts: dict[tuple[Any, Any], float] = {}
    slices: dict[tuple[Any, Any], list[tuple[float, float, int]]] = {}
    for i, ev in enumerate(events):
        where = f"event {i}"
        if not isinstance(ev, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = ev.get("ph")
        if not isinstance(ph, str) or ph not in _KNOWN_PH:
            problems.append(f"{where}: ph {ph!r} is not a trace event phase")
            continue
        where = f"event {i} (ph {ph})"
        if ph != "E" and not isinstance(ev.get("name"), str):
            problems.append(f"{where}: name must be a string, got {ev.get('name')!r}")
        if "name" in ev and not isinstance(ev["name"], str):
            problems.append(f"{where}: name must be a string")
        for k in ("pid", "tid"):
            if k not in ev:
                if not (ph == "M" and k == "tid"):
                    problems.append(f"{where}: no {k}")
            elif not _is_int(ev[k]):
                problems.append(f"{where}: {k} must be an integer, got {ev[k]!r}")
        ts = ev.get("ts")
        if ts is None and ph != "M":
            problems.append(f"{where}: no ts")
        elif ts is not None and (not _is_num(ts) or ts < 0):
            problems.append(f"{where}: ts must be a finite number >= 0, got {ts!r}")
            ts = None
        if "cat" in ev and not isinstance(ev["cat"], str):
            problems.append(f"{where}: cat must be a string")
        args = ev.get("args")
        if "args" in ev and not isinstance(args, dict):
            problems.append(f"{where}: args must be an object")
            args = None
        key = (ev.get("pid"), ev.get("tid"))
        if ph == "X":
            dur = ev.get("dur")
            if not _is_num(dur) or dur < 0:
                problems.append(f"{where}: dur must be a finite number >= 0, got {dur!r}")
            elif ts is not None:
                slices.setdefault(key, []).append((float(ts), float(ts) + float(dur), i))
        elif ph in ("B", "E"):
            if ts is not None:
                if ts < last_ts.get(key, -math.inf):
                    problems.append(f"{where}: ts goes back in time on pid/tid {key}")
                last_ts[key] = ts
            stack = open_b.setdefault(key, [])
            if ph == "B":
                stack.append((ev.get("name"), ts or 0.0))
            elif not stack:
                problems.append(f"{where}: E without an open B on pid/tid {key}")
            else:
                name, _ = stack.pop()
                if "name" in ev and ev["name"] != name:
                    problems.append(f"{where}: E {ev['name']!r} closes B {name!r}")
        elif ph == "C":
            if not args:
                problems.append(f"{where}: a counter needs args with at least one series")
            elif not all(_is_num(v) for v in args.values()):
                problems.append(f"{where}: counter values must be finite numbers")
        elif ph == "M":
            spec = _META_NAMES.get(ev.get("name"))  # type: ignore[arg-type]
            if spec is None:
                problems.append(f"{where}: unknown metadata name {ev.get('name')!r}")
            else:
                k, typ = spec
                v = (args or {}).get(k)
                ok = _is_int(v) if typ is int else isinstance(v, typ)
                if not ok:
                    problems.append(f"{where}: {ev.get('name')} needs args.{k} ({typ.__name__})")
        elif ph in ("i", "I") and ev.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where}: instant scope s must be g, p or t, got {ev.get('s')!r}")
    for key, stack in open_b.items():
        for name, _ in stack:
            problems.append(f"B {name!r} on pid/tid {key} is never closed by an E")
    eps = 1e-3  # ts and dur are rounded to the nanosecond
    for key, items in slices.items():
        items.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[float, float, int]] = []
        for s, e, i in items:
            while stack and stack[-1][1] <= s + eps:
                stack.pop()
            if stack and e > stack[-1][1] + eps:
                problems.append(
                    f"event {i} (ph X): overlaps event {stack[-1][2]} on pid/tid {key} "
                    "without nesting inside it"
                )
            stack.append((s, e, i))
    if problems:
        raise TraceFormatError(problems)


def counter_totals(trace: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Bytes per counter track of a trace: ``{track name: {"push_bytes": …, "pull_bytes": …}}``
    (the zero events that end a bucket add nothing)."""
    out: dict[str, dict[str, int]] = {}
    for ev in _events(trace):
        if ev.get("ph") == "C":
            tot = out.setdefault(ev["name"], {})
            for k, v in ev.get("args", {}).items():
                tot[k] = tot.get(k, 0) + int(v)
    return out


def _events(trace: dict[str, Any] | list) -> Iterable[dict[str, Any]]:
    return trace["traceEvents"] if isinstance(trace, dict) else trace
