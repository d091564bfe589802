"""Two workers that fail at once: each traceback stays together in ``hetps launch``'s
output (the launcher holds a traceback's lines until its exception line)."""

from __future__ import annotations

import re

from hetps.launch.tracebacks import MAX_LINES, TracebackLines

# 300 distinct frames (Python folds a frame repeated more than three times into one line)
CRASH = (
    'kv = hetps.kv.create("dist_sync")\n'
    "def f0():\n    raise ValueError(f'boom from worker {kv.rank}')\n"
    + "".join(f"def f{i}():\n    f{i - 1}()\n" for i in range(1, 300))
    + "kv.barrier()  # both fail at the same moment\nf299()\n"
)


def test_two_workers_tracebacks_do_not_interleave(cluster):
    rc, out = cluster(CRASH, workers=2)
    assert rc != 0
    lines = out.splitlines()
    for w in (0, 1):
        first = lines.index(f"[worker {w}] Traceback (most recent call last):")
        last = next(
            i for i, x in enumerate(lines) if re.match(rf"\[worker {w}\] ValueError: boom", x)
        )
        block = lines[first : last + 1]
        assert len(block) > 600, block  # the 300 frames, two lines each
        assert all(x.startswith(f"[worker {w}] ") for x in block), "\n".join(block)


def test_a_traceback_is_held_until_its_exception_line():
    t = TracebackLines()
    assert t.feed("hello") == ["hello"]
    assert t.feed("Traceback (most recent call last):") == []
    assert t.feed('  File "x.py", line 1, in <module>') == []
    assert t.feed("    f()") == []
    assert t.feed("") == []  # (a blank line inside a frame's source is held too)
    assert t.feed("KeyError: 'a'") == [
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "    f()",
        "",
        "KeyError: 'a'",
    ]
    assert t.feed("after") == ["after"]
    # a traceback cut short (the child was killed) comes out at the end, as it is
    assert t.feed("Traceback (most recent call last):") == []
    assert t.feed("  File") == []
    assert t.flush() == ["Traceback (most recent call last):", "  File"]
    # a runaway one is not held for ever
    t.feed("Traceback (most recent call last):")
    held = [t.feed(f"  frame {i}") for i in range(MAX_LINES - 1)]
    assert held[-1] and len(held[-1]) == MAX_LINES and not any(held[:-1])


def test_another_threads_line_inside_a_traceback_comes_after_it():
    """A child's log record written by another thread while its main thread prints a
    traceback (a node's receive thread saying a peer died) does not end the block early."""
    t = TracebackLines()
    assert t.feed("Traceback (most recent call last):") == []
    assert t.feed('  File "x.py", line 3, in <module>') == []
    assert t.feed("[2026-01-01 00:00:00,000] hetps.node ERROR: worker rank 1 exited") == []
    assert t.feed("    f()") == []
    assert t.feed("hetps.kv.CreateError: no secret") == [
        "Traceback (most recent call last):",
        '  File "x.py", line 3, in <module>',
        "    f()",
        "hetps.kv.CreateError: no secret",
        "[2026-01-01 00:00:00,000] hetps.node ERROR: worker rank 1 exited",
    ]
