"""A small W3C WebDriver client (urllib only) for Debian's headless Chromium and chromedriver.

    with Chrome(tmp_path) as b:
        b.get("http://127.0.0.1:9100/")
        b.wait("return document.body.dataset.polls >= 2", "two polls")
        b.js("return document.getElementById('rounds').textContent")
        b.severe_logs()          # the page's console errors
        b.screenshot(tmp_path / "page.png")

:func:`missing` says why a test must skip (no chromium or chromedriver on this machine).
The browser runs with a fresh profile in ``tmp`` and no network of its own (no sync, no
component updates, no QUIC); chromedriver and the browser are stopped on exit, whatever
happened.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1300",
]


def missing() -> str | None:
    """Why a browser test cannot run here (None: it can)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        return (
            "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        )
    return None


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


class Chrome:
    def __init__(self, tmp: Path) -> None:
        self.tmp = Path(tmp)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.session: str | None = None

    # -- WebDriver over HTTP ------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path, data=data, method=method,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"{}").get("value")
        except urllib.error.HTTPError as exc:
            raise AssertionError(
                f"webdriver {method} {path}: {exc.read().decode()[:500]}"
            ) from None

    def __enter__(self) -> Chrome:
        self.proc = subprocess.Popen(
            [CHROMEDRIVER, f"--port={self.port}", f"--log-path={self.tmp / 'chromedriver.log'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                if self._call("GET", "/status", timeout=2).get("ready"):
                    break
            except (OSError, AssertionError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise AssertionError("chromedriver did not come up within 20 s")
            time.sleep(0.05)  # between polls of chromedriver's /status
        profile = self.tmp / "chrome-profile"
        caps = {
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": CHROMIUM,
                        "args": FLAGS + [f"--user-data-dir={profile}"],
                    },
                    "goog:loggingPrefs": {"browser": "ALL"},
                }
            }
        }
        try:
            self.session = self._call("POST", "/session", caps, timeout=60)["sessionId"]
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.session is not None:
            try:
                self._call("DELETE", f"/session/{self.session}", timeout=10)
            except (OSError, AssertionError):
                pass
            self.session = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    def get(self, url: str) -> None:
        self._call("POST", self._s("/url"), {"url": url})

    def js(self, script: str, *args: Any) -> Any:
        return self._call("POST", self._s("/execute/sync"), {"script": script, "args": list(args)})

    def wait(self, script: str, what: str, timeout: float = 20.0) -> Any:
        """Run ``script`` until it returns something true; that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(script)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not seen within {timeout:g} s")
            time.sleep(0.05)  # between polls of the page (the condition is what is waited for)

    def logs(self) -> list[dict]:
        """The browser console's entries since the last call (chromedriver's log endpoint)."""
        return self._call("POST", self._s("/se/log"), {"type": "browser"}) or []

    def severe_logs(self) -> list[dict]:
        return [e for e in self.logs() if e.get("level") == "SEVERE"]

    def screenshot(self, path: Path) -> Path:
        png = base64.b64decode(self._call("GET", self._s("/screenshot")))
        assert png[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
        Path(path).write_bytes(png)
        return Path(path)
