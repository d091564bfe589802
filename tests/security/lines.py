"""A child's output, read line by line in a thread: tests wait for lines, never sleep."""

from __future__ import annotations

import re
import threading


class Lines:
    """Reads a child's output in a thread; :meth:`wait` blocks until a line matches."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.cv = threading.Condition()
        self.t = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.t.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()
        with self.cv:
            self.lines.append("")  # EOF
            self.cv.notify_all()

    def wait(self, pattern: str, timeout: float = 20.0) -> re.Match:
        rx = re.compile(pattern)
        with self.cv:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                if self.lines and self.lines[-1] == "":
                    raise AssertionError(f"no line matches {pattern!r}:\n{''.join(self.lines)}")
                if not self.cv.wait(timeout):
                    raise AssertionError(
                        f"no line {pattern!r} in {timeout} s:\n{''.join(self.lines)}"
                    )

    def wait_count(self, pattern: str, n: int, timeout: float = 20.0) -> int:
        """Block until ``n`` lines match (or the stream ends); returns how many matched."""
        rx = re.compile(pattern)
        with self.cv:
            while True:
                count = sum(1 for line in self.lines if rx.search(line))
                if count >= n or (self.lines and self.lines[-1] == ""):
                    return count
                if not self.cv.wait(timeout):
                    raise AssertionError(f"{count} of {n} lines {pattern!r} in {timeout} s")
