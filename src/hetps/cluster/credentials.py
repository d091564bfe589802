"""Per-node credentials: what a node proves who it is with when a restarted scheduler
(``--recover``) takes the running job back (docs/SECURITY.md, "A scheduler started again").
(docs/MODULES.md, "hetps.cluster.credentials")"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
from pathlib import Path

from hetps.config import private_state_dir
from hetps.transport.handshakes import RefusalLog

log = logging.getLogger("hetps.scheduler")

KEY_BYTES = 32
#: the largest node table file read back (a job of 100,000 nodes fits)
TABLE_MAX = 16 << 20


def key_dir() -> Path:
    """The directory of the scheduler's credential keys (created mode 0700)."""
    return Path(private_state_dir())


def key_path(port: int) -> Path:
    """The credential key file of a scheduler at ``port`` on this host."""
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname())
    return key_dir() / f"scheduler-{host or 'host'}-{int(port)}.key"


def table_path(port: int) -> Path:
    """The node table a scheduler at ``port`` keeps beside its key (what ``--recover``
    takes the job back from)."""
    return key_path(port).with_suffix(".nodes")


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path.parent, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path.parent} is not a directory of this user alone (chmod 700 it)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read_private(path: Path, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{path} is not a private file of this user")
        data = os.read(fd, limit)
    finally:
        os.close(fd)
    return data


def _read_key(path: Path) -> bytes:
    text = _read_private(path, 4 * KEY_BYTES).decode("ascii", "replace").strip()
    key = bytes.fromhex(text)
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} does not hold a {KEY_BYTES}-byte key")
    return key


class Credentials:
    """The scheduler's side: issues each admitted node its credential and checks the one a
    node presents to a restarted scheduler."""

    def __init__(self, port: int, recover: bool = False) -> None:
        self.path = key_path(port)
        self.table = table_path(port)
        self._table_written = False
        self.gens: dict[int, int] = {}  # node id -> its latest admission (0: registration)
        self._written = False
        self.problem: str | None = None  # why no node can be checked (--recover only)
        # refused readmits: a few lines per window, the rest counted (a flood fills no disk)
        self.refusals = RefusalLog("scheduler", "readmits")
        self.key: bytes | None
        if not recover:
            self.key = secrets.token_bytes(KEY_BYTES)  # written at the first credential
            return
        try:
            self.key = _read_key(self.path)
            self._written = True  # (its own: removed at the end like a fresh one's)
        except (OSError, ValueError) as exc:
            self.key = None
            self.problem = (
                f"no credential key of the scheduler that died ({self.path}: {exc}); was it "
                "started on this host, at this port, by this user? Without it no node can "
                "prove who it is"
            )
            log.warning("scheduler: started again (--recover) with %s", self.problem)

    def keep_table(self, state: dict) -> None:
        """Save the job's node table (ids, roles, ranks, addresses; the dead, the finished,
        the failovers) beside the key, signed with it: a scheduler started again takes the
        job back from this, never from what a node says of it."""
        if self.key is None:
            return
        body = json.dumps(state, sort_keys=True, separators=(",", ":"))
        mac = hmac.new(self.key, b"hetps node table " + body.encode(), hashlib.sha256)
        try:
            _write_private(self.table, (mac.hexdigest() + "\n" + body).encode())
            self._table_written = True
        except OSError as exc:
            log.warning(
                "scheduler: cannot keep the node table in %s (%s): a scheduler started "
                "again (--recover) could not take this job's nodes back",
                self.table,
                exc,
            )

    def saved_table(self) -> tuple[dict | None, str | None]:
        """The node table the scheduler that died kept (``--recover``), or None and why."""
        if self.key is None:
            return None, self.problem or "this scheduler has no credential key"
        try:
            mac, _, body = _read_private(self.table, TABLE_MAX).decode().partition("\n")
            want = hmac.new(self.key, b"hetps node table " + body.encode(), hashlib.sha256)
            if not hmac.compare_digest(mac, want.hexdigest()):
                raise ValueError("it is not signed with the scheduler's key")
            state = json.loads(body)
            if not isinstance(state, dict) or not isinstance(state.get("nodes"), list):
                raise ValueError("it holds no node table")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            return None, (
                f"no node table of the scheduler that died ({self.table}: {exc}); without it "
                "the job's membership is unknown"
            )
        self._table_written = True  # (its own: removed at the end like a fresh one's)
        return state, None

    def token(self, nid: int, gen: int) -> bytes:
        assert self.key is not None
        text = f"hetps node credential {int(nid)}.{int(gen)}".encode()
        return hmac.new(self.key, text, hashlib.sha256).digest()

    def issue(self, nid: int) -> dict:
        """The credential of node ``nid``'s new admission, as fields of its node table."""
        if self.key is None:  # (--recover without the key: a fresh one from now on)
            self.key = secrets.token_bytes(KEY_BYTES)
        if not self._written:
            self._written = True
            try:
                _write_private(self.path, self.key.hex().encode())
            except OSError as exc:
                log.warning(
                    "scheduler: cannot keep its credential key in %s (%s): a scheduler "
                    "started again (--recover) could not take this job's nodes back",
                    self.path,
                    exc,
                )
        gen = self.gens.get(nid, -1) + 1
        self.gens[nid] = gen
        return {"cred": self.token(nid, gen), "gen": gen}

    def check(self, nid: int, gen: object, cred: object) -> str | None:
        """Why a readmit as node ``nid`` with this credential is refused (None: it is that
        node). Records the admission it proves."""
        if self.key is None:
            return self.problem or "this scheduler has no credential key"
        if not isinstance(cred, bytes) or not isinstance(gen, int) or isinstance(gen, bool):
            return "it presents no credential (a node gets one when it registers)"
        if not 0 <= gen < 1 << 32 or not hmac.compare_digest(cred, self.token(nid, gen)):
            return "its credential is not the one this node id was given"
        if gen < self.gens.get(nid, -1):
            return f"its credential is of an admission (#{gen}) older than one already back"
        self.gens[nid] = gen
        return None

    def close(self) -> None:
        """The job is over: remove the key file and the node table (nothing can come back
        to it)."""
        if self._table_written:
            with contextlib.suppress(OSError):
                os.unlink(self.table)
        if self._written:
            try:
                if _read_key(self.path) == self.key:  # (not a newer scheduler's)
                    os.unlink(self.path)
            except (OSError, ValueError):
                pass
