"""The metrics commands: ``hetps summary`` and ``hetps plot`` read a LOGDIR of runs, print or
write summaries, draw PNGs; ``trace``, ``report`` and ``top`` are registered here too.

:func:`add_parser` registers every subcommand on the top-level subparsers
(``set_defaults(func=...)``, ``func(args) -> int``); :func:`main` takes an argv that starts
with ``summary`` or ``plot``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from hetps.metrics import report, top, trace
from hetps.metrics.records import MetricsError
from hetps.metrics.summary import format_summary, summarize, write_json

__all__ = ["add_parser", "build_parser", "cmd_plot", "cmd_summary", "main"]


def _window(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected START,END in seconds, e.g. 10,12"
        ) from e
    if b <= a:
        raise argparse.ArgumentTypeError(f"{text!r}: END must be greater than START")
    return a, b


def _warn(prog: str, errors: list[str]) -> None:
    for e in errors:
        print(f"{prog}: skipped a run: {e}", file=sys.stderr)


def cmd_summary(args: argparse.Namespace) -> int:
    """``hetps summary``: print a table per run; with ``--json FILE`` write the summary JSON."""
    errors: list[str] = []
    try:
        summary = summarize(args.logdir, errors=errors)
    except FileNotFoundError as e:
        print(f"hetps summary: {e}", file=sys.stderr)
        return 2
    _warn("hetps summary", errors)
    if not summary["runs"]:
        print(
            f"hetps summary: no runs under {args.logdir} (a run directory holds run.json)",
            file=sys.stderr,
        )
        if args.json:
            write_json(summary, args.json)
        return 1
    print(format_summary(summary), end="")
    if args.json:
        path = write_json(summary, args.json)
        print(f"wrote {path}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """``hetps plot``: write the figures as PNG files and print their paths."""
    from hetps.metrics.plot import plot

    errors: list[str] = []
    try:
        result = plot(
            args.logdir,
            out=args.out,
            run=args.run,
            window=args.window,
            only=args.figure or None,
            errors=errors,
        )
    except FileNotFoundError as e:
        print(f"hetps plot: {e}", file=sys.stderr)
        return 2
    except MetricsError as e:
        _warn("hetps plot", errors)
        print(f"hetps plot: {e}", file=sys.stderr)
        return 1
    _warn("hetps plot", errors)
    for note in result.notes:
        print(f"note: {note}")
    for path in result.written:
        print(f"wrote {path}")
    return 0 if result.written else 1


def add_parser(subparsers: Any) -> None:
    """Register ``summary``, ``plot``, ``trace``, ``report`` and ``top`` on a top-level
    ``add_subparsers()`` object; each sets ``func`` so the caller runs
    ``sys.exit(args.func(args))``."""
    window = dict(type=_window, metavar="START,END")
    run_dir = "a run directory (it holds run.json), e.g. runs/linreg-<time>"
    # name: (help, description, func, [(flags, add_argument's keywords), ...])
    commands: dict[str, tuple[str, str | None, Any, list[tuple[tuple[str, ...], dict]]]] = {
        "summary": (
            "time to accuracy, throughput, traffic, computing-time ratio, ASRIT per run",
            "Summarize every run (directory with run.json) under LOGDIR.",
            cmd_summary,
            [(("logdir",), dict(metavar="LOGDIR")),
             (("--json",), dict(metavar="FILE", help="also write the summary as JSON"))],
        ),
        "plot": (
            "draw accuracy, throughput, traffic and timeline figures (PNG)",
            "Draw the figures of the runs under LOGDIR as PNG files.",
            cmd_plot,
            [(("logdir",), dict(metavar="LOGDIR")),
             (("--out",), dict(metavar="DIR", help="output directory (default: LOGDIR/figures)")),
             (("--run",), dict(metavar="RUN", help="timelines of this run only (dir or name)")),
             (("--window",), dict(window, help="timelines (traffic, phases): only these seconds since run start")),
             (("--figure",), dict(action="append", metavar="NAME",
                                  help="draw only this figure (repeatable), e.g. traffic_timeline"))],
        ),
        "trace": (
            "a run's rounds, phases and link bytes as a Chrome/Perfetto trace (JSON)",
            "Write the trace-event JSON of one run directory (one holding run.json); open it "
            "in https://ui.perfetto.dev or chrome://tracing.",
            trace.cmd_trace,
            [(("run",), dict(metavar="RUN", help=run_dir)),
             (("-o", "--out"), dict(metavar="FILE", help="output file (default: RUN/trace.json)"))],
        ),
        "report": (
            "write one self-contained HTML report of a run directory",
            report.__doc__,
            report.cmd_report,
            [(("run",), dict(help=run_dir)),
             (("-o", "--output"), dict(help="where to write (default: RUN/report.html)"))],
        ),
        "top": (
            "a live terminal view of a running cluster (from its --metrics-port endpoint)",
            (top.__doc__ or "").split("\n\n")[0],
            top.main,
            [(("url",), dict(nargs="?", help="the scheduler's metrics URL (it prints it)")),
             (("--port",), dict(type=int, default=None, help="the metrics port, instead of a URL")),
             (("--host",), dict(default="127.0.0.1", help="with --port (default 127.0.0.1)")),
             (("--interval",), dict(type=float, default=1.0, help="seconds between scrapes (default 1)")),
             (("--once",), dict(action="store_true", help="print one frame and exit"))],
        ),
    }  # fmt: skip
    for name, (help_, description, func, arguments) in commands.items():
        p = subparsers.add_parser(
            name,
            help=help_,
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for flags, kw in arguments:
            p.add_argument(*flags, **kw)
        p.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser with the ``summary`` and ``plot`` subcommands."""
    parser = argparse.ArgumentParser(prog="hetps", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``summary ...`` or ``plot ...`` (argv without the program name); returns the code."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
