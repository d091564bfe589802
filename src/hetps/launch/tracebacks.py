"""Keep a child's traceback together in the launcher's output.
(docs/MODULES.md, "hetps.launch.tracebacks")"""

from __future__ import annotations

import re

__all__ = ["MAX_LINES", "TracebackLines"]

#: a held traceback longer than this is printed as it is (a deep recursion's)
MAX_LINES = 4000
_START = "Traceback (most recent call last):"
#: a traceback's last line: the exception's (dotted) name, maybe with its message
_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(: .*)?$")


class TracebackLines:
    """One child's output lines in, the lines to print now out (a traceback as one list)."""

    def __init__(self) -> None:
        self._held: list[str] = []
        # lines another thread of the child wrote while the traceback came (a log record):
        # printed after the traceback, not inside it
        self._aside: list[str] = []

    def feed(self, line: str) -> list[str]:
        """The lines to print after ``line`` (none while a traceback is still coming)."""
        if not self._held:
            if line.startswith(_START):
                self._held.append(line)
                return []
            return [line]
        flat = bool(line) and not line[0].isspace() and not line.startswith(_START)
        if flat and not _EXCEPTION.match(line):
            self._aside.append(line)  # not the traceback's: e.g. a log line of another thread
        else:
            self._held.append(line)
        if flat and _EXCEPTION.match(line) or len(self._held) + len(self._aside) >= MAX_LINES:
            return self.flush()
        return []

    def flush(self) -> list[str]:
        """The lines held (the child's output ended): printed as they are, the traceback
        first, then the lines that came from elsewhere while it was held."""
        held, aside, self._held, self._aside = self._held, self._aside, [], []
        return held + aside
