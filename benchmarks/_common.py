"""Helpers shared by the benchmarks: statistics, /proc memory readings, tables, machine info.

Nothing here imports hetps, so the helpers also work in a baseline's own process.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

#: environment for every child process: BLAS/OpenMP pinned to one thread.
PINNED_THREADS = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def git_head(root: str, paths: Sequence[str] = ("src",)) -> str:
    """The commit measured, short, with '+dirty' when ``paths`` (under ``root``) have local
    changes; '?' when git cannot tell."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            text=True,
            capture_output=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths],
            cwd=root,
            text=True,
            capture_output=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return (head or "?") + ("+dirty" if dirty else "")


def median(xs: Iterable[float]) -> float | None:
    """Median of ``xs`` (None when empty)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mean(xs: Iterable[float]) -> float | None:
    """Mean of ``xs`` (None when empty)."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """``Vm*`` lines of /proc/<pid>/status in KiB (empty when the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Vm"):
                    name, _, rest = line.partition(":")
                    parts = rest.split()
                    if parts and parts[0].isdigit():
                        out[name] = int(parts[0])
    except OSError:
        pass
    return out


def proc_env(pid: int | str) -> dict[str, str]:
    """Environment of a process (empty when it is gone or not ours)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return env


def find_tagged(tag: str, var: str = "BENCH_JOB") -> dict[int, dict[str, str]]:
    """Processes whose environment has ``var=tag``: pid -> {role, rank}."""
    found: dict[int, dict[str, str]] = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        env = proc_env(name)
        if env.get(var) != tag or "DMLC_ROLE" not in env:
            continue
        found[int(name)] = {
            "role": env["DMLC_ROLE"],
            "rank": env.get("HETPS_LAUNCH_RANK", ""),
        }
    return found


class PeakWatcher(threading.Thread):
    """Polls the peak RSS (VmHWM) of every process tagged ``BENCH_JOB=tag`` until stopped.

    VmHWM never decreases, so the last reading before a process exits is its peak up to that
    reading; the processes in these benchmarks peak during the rounds, before they exit. A
    process that lives less than a scan interval can be missed: hetps workers also read the
    figures from inside the job (see kvstore_throughput.py), which this complements.
    """

    def __init__(self, tag: str, interval: float = 0.05, scan_every: float = 0.1) -> None:
        super().__init__(daemon=True, name=f"peak-watcher-{tag}")
        self.tag = tag
        self.interval = interval
        self.scan_every = scan_every
        self.procs: dict[int, dict[str, Any]] = {}
        self._stop_evt = threading.Event()

    def run(self) -> None:
        last_scan = 0.0
        t_start = time.monotonic()
        while not self._stop_evt.is_set():
            now = time.monotonic()
            # processes appear at the start: look for them often then, rarely later
            every = self.scan_every if now - t_start < 15 else 10 * self.scan_every
            if now - last_scan >= every:
                for pid, info in find_tagged(self.tag).items():
                    self.procs.setdefault(pid, {**info, "hwm_kb": 0, "rss_kb": 0})
                last_scan = now
            for pid, info in self.procs.items():
                st = proc_status(pid)
                if st:
                    info["hwm_kb"] = max(info["hwm_kb"], st.get("VmHWM", 0))
                    info["rss_kb"] = st.get("VmRSS", 0)
            self._stop_evt.wait(self.interval)

    def stop(self) -> dict[str, list[int]]:
        """Stop polling; returns the peaks in KiB by role (one entry per process)."""
        self._stop_evt.set()
        self.join(timeout=5)
        by_role: dict[str, list[int]] = {}
        for info in self.procs.values():
            by_role.setdefault(info["role"], []).append(info["hwm_kb"])
        return by_role


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gb": mem_gb,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }
    for mod in ("numpy", "zmq"):
        try:
            m = __import__(mod)
            info[mod] = m.__version__
            if mod == "zmq":
                info["libzmq"] = m.zmq_version()
        except ImportError:
            pass
    return info


def fmt(x: Any, spec: str = ".4f") -> str:
    """Format a number, or '-' for None."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out=sys.stdout) -> str:
    """Print a plain-text table (also returned as a string)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append(
            "  ".join(c.rjust(w) if j else c.ljust(w) for c, w in zip(r, widths, strict=False))
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, file=out, flush=True)
    return text


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table in Markdown."""
    out = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as indented JSON (atomically)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


class LineCollector:
    """A file-like sink for a launcher's prefixed output: keeps every line, optionally echoes."""

    def __init__(self, echo: bool = False) -> None:
        self.lines: list[str] = []
        self.echo = echo
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buf += text
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                self.lines.append(line)
                if self.echo:
                    print(line, flush=True)
        return len(text)

    def flush(self) -> None:
        pass

    def tagged(self, marker: str) -> list[str]:
        """Text after ``marker`` on every line that holds it."""
        return [ln.split(marker, 1)[1].strip() for ln in self.lines if marker in ln]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(procs: list[tuple[str, list[str], dict[str, str]]], timeout: float) -> tuple:
    """Start every (name, argv, env) in its own process group, prefix its output lines with
    ``[name]``, wait for all (up to ``timeout``), stop what is left. The first process that
    exits with an error stops the group at once (its peers, e.g. a parameter server waiting
    for a worker that died, would otherwise wait until the deadline). (rc, lines)."""
    lines: list[str] = []
    lock = threading.Lock()
    ended = threading.Condition(lock)
    codes: dict[str, int] = {}
    started: list[tuple[str, subprocess.Popen, threading.Thread]] = []

    def pump(name: str, p: subprocess.Popen) -> None:
        for raw in p.stdout:
            with lock:
                lines.append(f"[{name}] {raw.rstrip()}")
        code = p.wait()
        with ended:
            codes[name] = code
            ended.notify_all()

    rc = 0
    try:
        for name, argv, env in procs:
            p = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            t = threading.Thread(target=pump, args=(name, p), daemon=True)
            t.start()
            started.append((name, p, t))
        deadline = time.monotonic() + timeout
        with ended:
            while True:
                failed = [(n, c) for n, c in codes.items() if c != 0]
                if failed:
                    name, code = failed[0]
                    lines.append(f"[bench] {name} exited with code {code}")
                    rc = code
                    break
                if len(codes) == len(started):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    running = [n for n, _, _ in started if n not in codes]
                    lines.append(
                        f"[bench] {', '.join(running)} still running after {timeout:g} s: stopped"
                    )
                    rc = 124
                    break
                ended.wait(left)
    finally:
        for _, p, _ in started:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for _, p, t in started:
            try:
                p.wait(timeout=15)  # hetps launch stops its own children first
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait()
            t.join(timeout=2)
    return rc, lines
