"""Where the dashboard's endpoint listens, tested on a real scheduler process: bound to the
scheduler's own (non-loopback) address, as `hetps k8s` configures it, it answers on loopback
too, where `kubectl port-forward` connects inside the pod (docs/RAY_K8S.md); it never binds
every interface, even when DMLC_PS_ROOT_URI says 0.0.0.0."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from security.lines import Lines

pytest.importorskip("prometheus_client")


def _own_address() -> str | None:
    """This machine's non-loopback IPv4 address (None: it has none)."""
    for probe in ("192.0.2.1", "10.255.255.255", "172.31.255.255", "192.168.255.255"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not addr.startswith("127.") and addr != "0.0.0.0":
            return addr
    return None


def _env(root: str, host: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DMLC_ROLE="scheduler", DMLC_PS_ROOT_URI=root, DMLC_PS_ROOT_PORT="0",
        DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="1", HETPS_METRICS_PORT="0",
        HETPS_METRICS_HOST=host, HETPS_SECRET=secrets.token_hex(32), HETPS_CONNECT_TIMEOUT="30",
        PYTHONUNBUFFERED="1",
    )  # fmt: skip
    return env


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read()


def test_bound_to_the_pod_address_it_answers_port_forward_on_loopback_too():
    addr = _own_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "scheduler"], env=_env(addr, addr),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out = Lines(proc.stdout)
        base = out.wait(r"hetps dashboard (http://\S+/)", timeout=30).group(1)
        port = int(base.rstrip("/").rsplit(":", 1)[1])
        assert base == f"http://{addr}:{port}/"
        # where kubectl port-forward connects inside the pod, and the pod's own address
        for url in (f"http://127.0.0.1:{port}/", f"http://{addr}:{port}/"):
            code, page = _get(url)
            assert code == 200 and b'<canvas id="timeline"' in page, url
        code, state = _get(f"http://127.0.0.1:{port}/api/state")
        assert code == 200 and b'"expected"' in state
        # and nowhere else: not every interface
        res = subprocess.run(["ss", "-Htln", f"sport = :{port}"], capture_output=True, text=True)
        if res.returncode == 0:
            bound = sorted(line.split()[3] for line in res.stdout.splitlines())
            assert bound == sorted([f"127.0.0.1:{port}", f"{addr}:{port}"]), bound
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("host", ["0.0.0.0", "0"])
def test_every_interface_is_refused_even_when_the_root_uri_says_so(host):
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "scheduler"], env=_env("0.0.0.0", host),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"HETPS_METRICS_HOST={host!r} means every interface" in res.stderr, res.stderr
    assert "never binds every interface" in res.stderr
    assert "hetps dashboard" not in res.stdout
