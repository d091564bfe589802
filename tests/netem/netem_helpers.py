"""Helpers shared by the netem tests (namespace listing, skip probe, child environment)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
try:
    import hetps.netem  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(SRC))

from hetps.netem import reap  # noqa: E402
from hetps.netem.emulator import find_tool  # noqa: E402

#: Devices the emulator creates; none of them may ever show up in the root namespace.
OUR_DEVICES = re.compile(r"^(v\d+|br0)$")


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return "netem tests need Linux network namespaces"
    if os.geteuid() != 0:
        return "netem tests need root (namespaces, veth, tc); run pytest as root"
    ip, tc = find_tool("ip"), find_tool("tc")
    if ip is None or tc is None:
        return "netem tests need iproute2 (ip and tc)"
    name = f"hps{os.getpid()}-{secrets.token_hex(3)}-n0"
    r = subprocess.run([ip, "netns", "add", name], capture_output=True, text=True, check=False)
    subprocess.run([ip, "netns", "del", name], capture_output=True, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    return None


_SKIP_REASON: list[str | None] = []


def skip_reason() -> str | None:
    """Why the netem tests cannot run here (cached), or ``None``."""
    if not _SKIP_REASON:
        _SKIP_REASON.append(_probe())
    return _SKIP_REASON[0]


def ip_tool() -> str:
    """Path of ``ip``."""
    ip = find_tool("ip")
    assert ip is not None
    return ip


def namespaces_with(prefix: str) -> list[str]:
    """Live namespace names starting with ``prefix``."""
    return [n for n in reap.list_namespaces(ip_tool()) if n.startswith(prefix)]


def root_links() -> set[str]:
    """Interface names in the caller's namespace."""
    out = subprocess.run(
        [ip_tool(), "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def child_env() -> dict[str, str]:
    """Environment for Python children that import hetps from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    return env
