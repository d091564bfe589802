"""A row of the configuration table (:class:`Var`): one environment variable, its type, bounds
and meaning, and the parsing of one value, whose errors (:class:`ConfigError`) name the
variable and the fix."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration variable is missing or malformed; the message names it and the fix."""


#: A row's ``check``: (its parsed value, every parsed value by variable name) -> the error
#: message, or None when the value is fine. It runs once all rows are parsed, so a rule over
#: two variables lives in one row; a variable it needs that is unset or bad is absent.
Check = Callable[[Any, Mapping[str, Any]], "str | None"]
#: A row's ``derive``: (every parsed value) -> (value, what it came from) for an unset
#: variable whose value follows from others, None when it cannot tell yet; may raise.
Derive = Callable[[Mapping[str, Any]], "tuple[Any, str] | None"]

REQUIRED: Any = dataclasses.MISSING  # a row's default when the variable must be set

KINDS = {  # kind -> (Python type, how the docs say it, what an error asks for)
    "int": (int, "integer", "an integer"),
    "float": (float, "number", "a number"),
    "str": (str, "string", "a string"),
    "choice": (str, "choice", "one of"),
    "flag": (bool, "0 / 1", "an integer >= 0"),
}


@dataclass(frozen=True)
class Var:
    """One row of the table: an environment variable hetps reads (or sets for others)."""

    name: str
    kind: str  # int, float, str, choice (one of ``choices``), flag (integer > 0 = on)
    default: Any  # REQUIRED: a cluster node needs it set
    meaning: str  # one line a user understands
    field: str | None = None  # the NodeConfig field it fills; None: read by a command
    aliases: tuple[str, ...] = ()  # other names (read after ``name``; the first one set wins)
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | Callable[[], tuple[str, ...] | None] = ()  # or read when used
    noun: str = ""  # what a choice is called in errors ("a role")
    lower: bool = False  # a choice is case-insensitive
    cap: float | None = None  # values above count as this (not an error)
    unit: str = ""  # bytes, seconds, ... (docs and display)
    expect: str = ""  # what to set it to, in errors (default: from kind and bounds)
    bounds: str = ""  # the docs' bounds column (default: from minimum/maximum/choices)
    default_text: str = ""  # the docs' default column (default: the default)
    check: Check | None = None
    derive: Derive | None = None
    provided: bool = False  # hetps sets it for the commands it starts; it is shown, not parsed
    hidden: bool = False  # a secret: ``hetps config`` says whether it is set, never the value

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def options(self) -> tuple[str, ...] | None:
        """The allowed values of a choice now (None: not known in this process)."""
        return self.choices() if callable(self.choices) else self.choices

    def expectation(self) -> str:
        """What the variable should be set to, as an error's fix says it."""
        if self.expect:
            return self.expect
        if self.kind == "choice":
            return "one of " + ", ".join(self.options or ())
        if self.kind == "flag":
            return "1 (on) or 0 (off)"
        return f"{KINDS[self.kind][2]} {self.span()}".rstrip()

    def span(self) -> str:
        """The bounds of a number: ``from MIN to MAX``, ``>= MIN`` or nothing."""
        if self.minimum is not None and self.maximum is not None:
            return f"from {self.minimum} to {self.maximum}"
        return f">= {self.minimum}" if self.minimum is not None else ""

    def parse(self, raw: str, name: str | None = None) -> Any:
        """The value of ``raw`` (stripped, non-empty) given as ``name`` (default: the row's
        name); raises ConfigError naming the variable and the fix. Cross-variable rules
        (``check``) are not applied here."""
        name = name or self.name
        fix = f"set {name} to {self.expectation()}"
        if self.provided or self.kind == "str":
            return raw
        if self.kind == "choice":
            value = raw.lower() if self.lower else raw
            if self.options is not None and value not in self.options:
                noun = self.noun or "a choice"
                raise ConfigError(f"{name}={value!r} is not {noun}: {fix}")
            return value
        if self.kind == "float":
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if math.isnan(value):
                raise ConfigError(f"{name}={raw!r} is not a number: {fix}") from None
        else:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer: {fix}") from None
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{name}={value} is below {self.minimum}: {fix}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(f"{name}={value} is above {self.maximum}: {fix}")
        if self.cap is not None:
            value = min(value, type(value)(self.cap))
        if self.kind == "flag":
            return value > 0
        return value
