"""Every command declared once, and the data plane's requests: a key's chunks (init, push,
pull) and a table's parts (sinit, spush, spull, sdump, sload).
(docs/MODULES.md, "hetps.cluster.bodies")"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from dataclasses import field as dfield
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, field

from hetps.cluster import protocol as P

#: a count or an offset in elements, or a part index
Count = Annotated[int, Meta(ge=0)]
#: a key: an int or a str of at most 1,024 characters (never a bool)
Key = int | Annotated[str, Meta(max_length=1024)]
#: a key's shape
Shape = Annotated[list[Count], Meta(max_length=32)]
#: a dtype's wire name as a request states it (matched against the key's by the handler)
DTypeName = Annotated[str, Meta(max_length=16)]
#: the dtypes a dense key may have (an init refuses the others)
KeyDType = Literal["float16", "float32", "float64"]
#: a 2-bit compression threshold: positive and finite
Threshold = Annotated[float, Meta(gt=0, le=sys.float_info.max)]
#: a finite number
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]

#: who may send a command (see :mod:`hetps.cluster.allow`)
NODES = frozenset({P.SERVER, P.WORKER})
W = frozenset({P.WORKER})
S = frozenset({P.SERVER})
SCHED = frozenset({P.SCHEDULER})


@dataclass(frozen=True)
class Declared:
    """One command as :func:`command` declared it."""

    #: the body's type: a Struct, or a union of Structs told apart by a tag field
    kind: Any
    #: receiving role -> the roles that may send it (as a request or a notice)
    to: dict[str, frozenset[str]]
    #: the answer's type (None: its request reads it as it is), and its command (None: ``cmd``)
    reply: Any = None
    answer: str | None = None
    #: meanings of this command's own (beside those of its type's docstring)
    doc: dict[str, str] = dfield(default_factory=dict)


#: every command, as declared
DECLARED: dict[str, Declared] = {}


def command(
    cmd: str,
    kind: Any = None,
    *,
    reply: Any = None,
    answer: str | None = None,
    doc: dict[str, str] | None = None,
    **to: Any,
) -> Any:
    """Declare ``cmd``: its body's type ``kind`` (or decorate the type), the type of its
    answer (and the answer's command, when not ``cmd``), meanings of its own, and per
    receiving role (``scheduler=``, ``server=``, ``worker=``) the roles that may send it."""
    if cmd in DECLARED:
        raise ValueError(f"command {cmd!r} is declared twice: declare each command once")
    if not to or set(to) - {P.SCHEDULER, P.SERVER, P.WORKER}:
        raise ValueError(
            f"command {cmd!r}: name who takes it as scheduler=, server= or worker= "
            f"(got {sorted(to) or 'none'})"
        )

    def declare(kind: Any) -> Any:
        DECLARED[cmd] = Declared(kind, to, reply, answer, doc or {})
        return kind

    return declare if kind is None else declare(kind)


def meanings(cmd: str, kind: Any = None) -> dict[str, str]:
    """What each wire key of ``cmd``'s body (of ``kind``: its answer's, say) means: the
    lines ````key``: meaning`` of the docstrings of its type and their bases, and the
    command's own."""
    declared = DECLARED.get(cmd)
    kind = kind if kind is not None else declared.kind if declared else None
    out: dict[str, str] = {}
    for member in getattr(kind, "__args__", None) or ((kind,) if kind else ()):
        for base in reversed(member.__mro__):
            out.update(_fields_doc(base))
    out.update(declared.doc if declared else {})
    return out


def _fields_doc(cls: type) -> dict[str, str]:
    """The ````key``: meaning`` lines of ``cls``'s own docstring (each goes on to the next
    such line or a blank one)."""
    out: dict[str, str] = {}
    last = None
    for line in inspect.cleandoc(vars(cls).get("__doc__") or "").splitlines():
        entry = _ENTRY.match(line)
        if entry is not None:
            last = entry[1]
            out[last] = entry[2]
        elif last is not None and line.strip():
            out[last] += " " + line.strip()
        else:
            last = None
    return out


_ENTRY = re.compile(r"``([^`]+)``: (.*)")
#: msgspec's text for a list over its bound
_MORE = re.compile(r"expected `array` of length <= (\d+)")


class BadBody(ValueError):
    """A body that is not of its command's declared type; the text names the field."""


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A command's body (each subclass says ``kw_only`` again: msgspec does not inherit it)."""


class Chunk(Body, kw_only=True):
    """What every chunk request carries: a range of one part of one key.

    ``k``: the key
    ``part``: the part index
    ``off``: offset of this chunk within the part, in elements
    ``n``: elements in this chunk
    ``shape``: the key's shape (checked against the server's)
    ``dtype``: the key's dtype name
    ``tag``: the request id its forecast carried (the transfer is timed)"""

    key: Key = field(name="k")
    part: Count
    offset: Count = field(name="off")
    count: Count = field(name="n")
    shape: Shape | None = None
    dtype: DTypeName | None = None
    tag: int | None = None


class DataAnswer(Body, kw_only=True):
    """A server's answer to a push, a pull or a probe (its arrays: a pull's values).

    ``meas``: [start, end, bytes] of a timed request's arrival, as the server measured it (a
        fourth entry, 1: its start was stamped late)
    ``w``: a pull's value sums this many workers' pushes, fewer than the job's (a worker left)"""

    meas: Annotated[list[Finite], Meta(min_length=3, max_length=4)] | None = None
    workers: Annotated[int, Meta(ge=1)] | None = field(default=None, name="w")


_NO_NEWS = DataAnswer()


def answer(reply: Any) -> DataAnswer:
    """``reply`` (a server's answer to a push, a pull or a probe) as a :class:`DataAnswer`,
    decoded on its first read and kept on ``reply.typed``; one that is not (or an answer
    made here, of no body) reads as an empty one: nothing measured, every worker summed."""
    if not reply.body:  # (most answers: nothing to decode)
        return _NO_NEWS
    if not isinstance(reply.typed, DataAnswer):
        try:
            reply.typed = msgspec.convert(reply.body, DataAnswer)
        except msgspec.ValidationError:
            reply.typed = DataAnswer()
    return reply.typed


@command(P.PULL, server=W)
class Pull(Chunk, kw_only=True):
    """A pull: the range's values are the answer."""


@command(P.PUSH, server=W)
class Push(Chunk, kw_only=True):
    """A push of the range's values (or their 2-bit words).

    ``ce``: elements per chunk the worker cuts parts into
    ``sync``: true in dist_sync (rounds), false in dist_async
    ``pp``: a fused push-pull: answer with the value once the push took effect
    ``comp``: 2-bit compression threshold (the payload is packed 2-bit words)
    ``rcpt``: send a receipt on arrival (push-window credit)
    ``rnd``: with HETPS_REPLICAS > 1, the worker's count of its earlier pushes of this key: a server
        that applied that round already acknowledges a resent push without applying it again, and
        keeps one of a later round until its round comes
    ``hg``: dist_sync with host groups known: [host group, local rank, workers]: the push is that
        host's (workers > 1: the host's sum, counted for that many workers); the server sums a round
        per host in local-rank order, then the hosts in group order"""

    #: (every worker's push carries it; the server says so where it needs it and it is missing)
    chunk: Annotated[int, Meta(ge=1)] | None = field(default=None, name="ce")
    sync: bool = True
    fused: bool = field(default=False, name="pp")
    threshold: Threshold | None = field(default=None, name="comp")
    receipt: bool = field(default=False, name="rcpt")
    round: Count | None = field(default=None, name="rnd")
    host: tuple[Count, Count, Annotated[int, Meta(ge=1)]] | None = field(default=None, name="hg")


@command(P.INIT, server=W)
class Init(Chunk, tag_field="op", tag="init", kw_only=True):
    """A chunk of a key's first value (or a replica's copy of one: ``op`` = ``init``, its tag among
    the bodies of a replicate, :data:`hetps.cluster.commands.Replicate`).

    ``dtype``: the key's dtype name (float16, float32 or float64)
    ``size``: elements of the whole part
    ``rnd``: the rounds the part has had (a slice a plan moves comes with them; default 0)
    ``op``: init, in a primary's copy to a replica (a replicate message)"""

    shape: Shape
    dtype: KeyDType
    size: Count
    round: Count = field(default=0, name="rnd")


#: the declared body of each chunk command
TYPES: dict[str, type[Chunk]] = {P.INIT: Init, P.PUSH: Push, P.PULL: Pull}


# -- row-sparse keys (tables) -----------------------------------------------------------------
class TablePart(Body, kw_only=True):
    """``k``: the key
    ``part``: the server's part of the table (row r lives on part r % nparts)"""

    key: Key = field(name="k")
    part: Count


@command(P.SINIT, server=W)  # (a pickle in opt: only from a registered worker)
class SInit(TablePart, kw_only=True):
    """``nparts``: parts of the table (the servers)
    ``rows``: rows of the whole table (None: a table that grows)
    ``cols``: columns
    ``dtype``: the table's dtype name
    ``scale``: rows start uniform in [-scale, scale) (0: zeros)
    ``seed``: seed of the initial values
    ``bound``: bytes this server may hold of the table (0: no bound)
    ``opt``: optional: the table's own optimizer, pickled (accepted from a worker only)
    ``(arrays)``: optional: row ids (int64) and their first values (rows x cols)"""

    parts: Annotated[int, Meta(ge=1)] = field(name="nparts")
    rows: Count | None
    cols: Annotated[int, Meta(ge=1, le=1 << 20)]
    dtype: KeyDType
    scale: Finite = 0.0
    seed: Count = 0
    bound: Count = 0
    optimizer: bytes | None = field(default=None, name="opt")


@command(P.SPUSH, server=W)
class SPush(TablePart, kw_only=True):
    """``sync``: true in dist_sync (rounds: every worker pushes once per round, maybe no rows),
        false in dist_async
    ``(arrays)``: sorted distinct row ids (int64) and their gradient rows (ids x cols)
    ``rnd``: with HETPS_REPLICAS > 1, the worker's count of its earlier pushes of the table: a
        server that applied that round already acknowledges a resent push without applying it again,
        and keeps one of a later round until its round comes
    ``hg``: as a dense push's (a host's merged ids and rows, summed in local-rank order)"""

    sync: bool = True
    round: Count | None = field(default=None, name="rnd")
    host: tuple[Count, Count, Annotated[int, Meta(ge=1)]] | None = field(default=None, name="hg")


@command(P.SPULL, server=W)
class SPull(TablePart, kw_only=True):
    """``(arrays)``: row ids (int64); the answer: their rows, in that order"""


@command(P.SDUMP, server=W)  # a checkpoint reads a table (tables' dump)
class SDump(TablePart, kw_only=True):
    """``off``: the first row wanted of the part's used rows, sorted by id
    ``n``: rows wanted (0: only the answer's body)
    ``(answer)``: count (the part's used rows), state ([[name, dtype, columns], ...]: the optimizer
        state's per-row arrays), numbers (its other entries: Adam's t), has_state; arrays: the rows'
        ids, their values, each state array's rows"""

    offset: Count = field(default=0, name="off")
    count: Count = field(default=0, name="n")


@command(P.SLOAD, server=W)  # a restore writes it back
class SLoad(TablePart, kw_only=True):
    """``fresh``: the part's first chunk: start it again empty, with the state's numbers
    ``state``: names of the optimizer state's per-row arrays that follow the rows
    ``numbers``: the optimizer state's other entries (Adam's t)
    ``(arrays)``: sorted distinct row ids (int64), their values, each state array's rows"""

    fresh: bool = False
    state: list[Annotated[str, Meta(max_length=64)]] = []
    numbers: dict[str, int | float] = {}


def decode(cmd: str, body: Any, kind: type[Chunk]) -> Any:
    """``body`` (a decoded header's body map) as a ``kind``, checked; raises
    :class:`BadBody` with a text that names the command, the key and the field."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise BadBody(explain(cmd, body, kind, str(exc))) from None


def explain(cmd: str, body: Any, kind: Any, text: str) -> str:
    """msgspec's ``Expected `int` >= 0 - at `$.off``` as ``push of key 'w': field 'off'
    (offset of this chunk within the part): expected `int` >= 0``. ``kind``: a Struct, or a
    union of Structs told apart by a tag field (the one the body names is explained)."""
    key = body.get("k") if isinstance(body, dict) else None
    keyed = isinstance(key, (int, str)) and not isinstance(key, bool)
    what = f"{cmd} of key {_short(key)}" if keyed else cmd
    wire = _wire(kind, body)
    inner = text.partition(" - at `$.")[2].rstrip("`")
    if text.startswith("Object contains unknown field") and inner:  # in a map of a field
        name, outer = text.split("`")[1], inner.split("[")[0].split(".")[0]
        return (
            f"{what}: field {outer!r} ({_meaning(cmd, wire, outer, kind)}): unknown field "
            f"{_short(name)} at {inner}"
        )
    if text.startswith("Object contains unknown field"):
        name = text.split("`")[1]
        known = ", ".join(sorted(wire)) or "no fields"
        article = "an" if cmd[:1] in "aeiou" else "a"
        return f"{what}: unknown field {_short(name)} ({article} {cmd} body has {known})"
    if text.startswith("Object missing required field"):
        name = text.split("`")[1]
        return f"{what}: field {name!r} ({_meaning(cmd, wire, name, kind)}) is missing"
    problem, _, where = text.partition(" - at `")
    keyed_map = where.startswith("key` in `")  # (a map's key is wrong, not its value)
    path = where.removeprefix("key` in `").removeprefix("$").rstrip("`").lstrip(".")
    name = path.split("[")[0].split(".")[0]
    if not name:
        return f"{what}: the body must be a map ({problem})"
    problem = _MORE.sub(r"more than \1 entries", problem[:1].lower() + problem[1:])
    at = f" at {path}" if path != name else ""
    at += " (a key of the map)" if keyed_map else ""
    return f"{what}: field {name!r} ({_meaning(cmd, wire, name, kind)}): {problem}{at}"


def _wire(kind: Any, body: Any) -> dict[str, str]:
    """The wire names of ``kind``'s fields (with its tag field) -> attribute names; of the
    member of a union that ``body``'s tag names (every member's, when it names none)."""
    members = getattr(kind, "__args__", None) or (kind,)
    out: dict[str, str] = {}
    for member in members:
        config = member.__struct_config__
        tag = config.tag_field
        if len(members) > 1 and isinstance(body, dict) and body.get(tag) != config.tag:
            continue
        if tag is not None:
            out[tag] = tag
        out.update({f.encode_name: f.name for f in msgspec.structs.fields(member)})
    if not out and len(members) > 1:
        for member in members:
            out.update(_wire(member, None))
    return out


def _meaning(cmd: str, wire: dict[str, str], name: str, kind: Any = None) -> str:
    # (a field of one of several types: what it means in that one, else in the command)
    return meanings(cmd, kind).get(name) or meanings(cmd).get(name, wire.get(name, name))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def chunk(
    key: Any,
    part: int,
    offset: int,
    count: int,
    shape: Any,
    dtype: str,
    *,
    size: int | None = None,
    chunk: int | None = None,
    sync: bool | None = None,
    fused: bool | None = None,
    round: int | None = None,
    threshold: float | None = None,
    receipt: bool | None = None,
    host: tuple[int, int, int] | None = None,
) -> dict[str, Any]:
    """The wire body of a chunk request: the range, the key's shape and dtype, and the
    command's own fields by their attribute names (an init's ``size``; a push's ``chunk``,
    ``sync``, ``fused``, ``threshold``, ``receipt``, ``host``; either's ``round``), those
    that are None left out."""
    body: dict[str, Any] = {
        "k": key,
        "part": part,
        "off": offset,
        "n": count,
        "shape": list(shape),
        "dtype": dtype,
    }
    own = (size, chunk, sync, fused, round, threshold, receipt, host and list(host))
    for name, value in zip(_OWN, own):  # noqa: B905 - 8 and 8 (strict= costs 0.15 us)
        if value is not None:
            body[name] = value
    return body


#: the wire keys of :func:`chunk`'s own fields, in the order of its arguments
_OWN = ("size", "ce", "sync", "pp", "rnd", "comp", "rcpt", "hg")


def chunk_elems(chunk_bytes: int, itemsize: int) -> int:
    """Elements per chunk: a multiple of 16 (so 2-bit packed words never straddle chunks)."""
    return max(16, (chunk_bytes // itemsize) // 16 * 16)
