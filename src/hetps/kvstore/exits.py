"""How a worker's script ended, as far as its store's exit hook can know.
(docs/MODULES.md, "hetps.kvstore.exits")"""

from __future__ import annotations

import builtins
import sys
from typing import Any

_member = SystemExit.__dict__["code"]  # the C slot SystemExit keeps its code in
_status: list[Any] = []  # the code the interpreter ends with, when it is a failure


class ScriptExit(SystemExit):
    """What ``sys.exit`` raises in a worker process (a SystemExit in every other respect)."""

    @property  # type: ignore[override]
    def code(self) -> Any:
        value = _member.__get__(self, SystemExit)
        if sys._getframe(0).f_back is None and value not in (None, 0) and not _status:
            _status.append(value)  # the interpreter's own exit handling reads it: the end
        return value

    @code.setter
    def code(self, value: Any) -> None:
        _member.__set__(self, value)


def _exit(status: Any = None) -> None:
    raise ScriptExit(status)


class _Quitter:
    """``exit``/``quit`` of the interactive builtins, raising :class:`ScriptExit`."""

    def __init__(self, original: Any) -> None:
        self._original = original

    def __repr__(self) -> str:
        return repr(self._original)

    def __call__(self, code: Any = None) -> None:
        try:
            sys.stdin.close()  # as site's Quitter does
        except Exception:  # noqa: BLE001 - best effort, as there
            pass
        raise ScriptExit(code)


def watch() -> None:
    """Make ``sys.exit``, ``exit`` and ``quit`` raise :class:`ScriptExit` (once per process)."""
    if sys.exit is _exit:
        return
    sys.exit = _exit
    # the name a script's ``raise SystemExit(3)`` looks up (its globals, then the builtins)
    builtins.SystemExit = ScriptExit  # type: ignore[misc]
    for name in ("exit", "quit"):
        original = getattr(builtins, name, None)
        if original is not None and not isinstance(original, _Quitter):
            setattr(builtins, name, _Quitter(original))


def failing() -> str | None:
    """Why the script is failing, if it ends through ``sys.exit`` with a failing status (a
    non-zero number, or a message: exit status 1); else None."""
    if not _status:
        return None
    value = _status[0]
    if isinstance(value, int):
        return f"the script exited with code {value} (sys.exit)"
    return f"the script exited with an error (sys.exit): {value}"
