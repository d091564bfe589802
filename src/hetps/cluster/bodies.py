"""The bodies of the chunk requests (init, push, pull) as declared types.

A chunk request names a range of one part of one key. Its body travels as a msgpack map in
the message header (:mod:`hetps.transport.codec`) under short wire keys (``k``, ``part``,
``off``, ``n``, ``ce``, ``pp``, ...; their meanings are in
:data:`hetps.cluster.protocol.BODY_FIELDS`); here each command's body is a
:class:`msgspec.Struct` with readable attribute names (``key``, ``offset``, ``count``,
``chunk``, ``fused``, ...) mapped onto those wire keys, so the wire is unchanged.

:func:`decode` is the one place such a body is checked: every field's type, every bound
(a key of at most 1,024 characters, offsets and counts >= 0, chunks > 0, a shape of at
most 32 non-negative dimensions, a finite positive compression threshold, a dtype a key
may have) and the absence of any field the command does not know are checked by msgspec,
in C, before a handler reads anything. What needs the server's state (does the key exist,
does the range fit its part, does the payload match) is checked by the handlers
(:mod:`hetps.kvstore.checks`).

:func:`chunk` builds the body a worker sends, the one builder of these maps.
"""

from __future__ import annotations

import sys
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


class BadBody(ValueError):
    """A body that is not of its command's declared type; the text names the field."""


class Chunk(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What every chunk request carries: a range of one part of one key."""

    key: Key = field(name="k")
    part: Count
    offset: Count = field(name="off")
    count: Count = field(name="n")
    #: the key's shape and dtype as the worker knows them (checked against the server's)
    shape: Shape | None = None
    dtype: DTypeName | None = None
    #: the request id its forecast carried: the transfer is timed (network-aware balancing)
    tag: int | None = None


class Pull(Chunk):
    """A pull: the range's values are the answer."""


class Push(Chunk):
    """A push of the range's values (or their 2-bit words)."""

    #: elements per chunk the worker cuts parts into (every worker's push carries it; the
    #: server needs it where it merges the push, and says so there when it is missing)
    chunk: Annotated[int, Meta(ge=1)] | None = field(default=None, name="ce")
    #: dist_sync (rounds) or dist_async
    sync: bool = True
    #: a fused push-pull: the answer carries the value once the push took effect
    fused: bool = field(default=False, name="pp")
    #: the payload is 2-bit words of this threshold
    threshold: Threshold | None = field(default=None, name="comp")
    #: the worker wants a receipt on arrival (push-window credit)
    receipt: bool = field(default=False, name="rcpt")
    #: with HETPS_REPLICAS > 1, the worker's count of its earlier pushes of this key
    round: Count | None = field(default=None, name="rnd")
    #: dist_sync with host groups known: (host group, local rank, workers it stands for)
    host: tuple[Count, Count, Annotated[int, Meta(ge=1)]] | None = field(default=None, name="hg")


class Init(Chunk, tag_field="op", tag="init"):
    """A chunk of a key's first value (or a replica's copy of one: ``op`` = ``init``, its
    tag among the bodies of a replicate, :data:`hetps.cluster.commands.Replicate`)."""

    shape: Shape
    dtype: KeyDType
    #: elements of the whole part
    size: Count
    #: the rounds the part has had (a slice a plan moves comes with them)
    round: Count = field(default=0, name="rnd")


#: the declared body of each chunk command
TYPES: dict[str, type[Chunk]] = {P.INIT: Init, P.PUSH: Push, P.PULL: Pull}


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
            f"{what}: field {outer!r} ({_meaning(cmd, wire, outer)}): unknown field "
            f"{_short(name)} at {inner}"
        )
    if text.startswith("Object contains unknown field"):
        name = text.split("`")[1]
        known = ", ".join(sorted(wire)) or "no fields"
        article = "an" if cmd[:1] in "aeiou" else "a"
        return f"{what}: unknown field {_short(name)} ({article} {cmd} body has {known})"
    if text.startswith("Object missing required field"):
        name = text.split("`")[1]
        return f"{what}: field {name!r} ({_meaning(cmd, wire, name)}) is missing"
    problem, _, where = text.partition(" - at `")
    keyed_map = where.startswith("key` in `")  # (a map's key is wrong, not its value)
    path = where.removeprefix("key` in `").removeprefix("$").rstrip("`").lstrip(".")
    name = path.split("[")[0].split(".")[0]
    if not name:
        return f"{what}: the body must be a map ({problem})"
    problem = problem[:1].lower() + problem[1:]
    at = f" at {path}" if path != name else ""
    at += " (a key of the map)" if keyed_map else ""
    return f"{what}: field {name!r} ({_meaning(cmd, wire, name)}): {problem}{at}"


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


def _meaning(cmd: str, wire: dict[str, str], name: str) -> str:
    return P.BODY_FIELDS.get(cmd, {}).get(name, wire.get(name, name))


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
    ``sync``, ``fused``, ``threshold``, ``receipt``, ``host``; either's ``round``), those that are None
    left out. (Written out, not looped over: a worker builds one per chunk it sends.)"""
    body: dict[str, Any] = {
        "k": key,
        "part": part,
        "off": offset,
        "n": count,
        "shape": list(shape),
        "dtype": dtype,
    }
    if size is not None:
        body["size"] = size
    if chunk is not None:
        body["ce"] = chunk
    if sync is not None:
        body["sync"] = sync
    if fused is not None:
        body["pp"] = fused
    if round is not None:
        body["rnd"] = round
    if threshold is not None:
        body["comp"] = threshold
    if receipt is not None:
        body["rcpt"] = receipt
    if host is not None:
        body["hg"] = list(host)
    return body
