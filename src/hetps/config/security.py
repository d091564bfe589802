"""The cluster secret (``HETPS_SECRET`` or an owner-only ``HETPS_SECRET_FILE``), the
``HETPS_INSECURE`` opt-out, and the refusal to run without a secret on an address others
can reach."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from hetps.config.addresses import is_loopback
from hetps.config.resolve import env_raw, env_value
from hetps.config.rows import ConfigError
from hetps.config.table import MIN_SECRET_CHARS


def private_state_dir(env: Mapping[str, str] | None = None) -> str:
    """Where hetps keeps small private files of a user between processes (the scheduler's
    credential key): ``$XDG_RUNTIME_DIR/hetps`` when that is a directory, else
    ``~/.cache/hetps``."""
    env = os.environ if env is None else env
    runtime = (env.get("XDG_RUNTIME_DIR") or "").strip()
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "hetps")
    return os.path.join(os.path.expanduser("~"), ".cache", "hetps")


def security_from_env(env: Mapping[str, str] | None = None) -> tuple[bytes | None, bool]:
    """The cluster secret and the HETPS_INSECURE opt-out: ``(secret or None, insecure)``.

    The secret comes from ``HETPS_SECRET`` (the secret itself; ``hetps launch`` hands it to
    every process it starts this way) or ``HETPS_SECRET_FILE`` (a file holding it, readable
    by its owner alone, as ``hetps secret FILE`` writes it). Raises :class:`ConfigError` when
    both are set, when the file is missing or open to others, when the secret is too short,
    or when ``HETPS_INSECURE=1`` comes with a secret.
    """
    env = os.environ if env is None else env
    value = env_raw(env, "HETPS_SECRET")
    path = env_raw(env, "HETPS_SECRET_FILE")
    insecure = bool(env_value("HETPS_INSECURE", env))
    if value is None and path is None:
        # set but blank: a secret was meant (a file name or a value that came out empty),
        # and it must not turn security off
        for name in ("HETPS_SECRET_FILE", "HETPS_SECRET"):
            if name in env:
                what = "names no file" if name.endswith("FILE") else "holds no secret"
                raise ConfigError(
                    f"{name} is set but {what} (it is empty or blank): set it to "
                    + (
                        "a file made by `hetps secret FILE`"
                        if name.endswith("FILE")
                        else f"a secret of at least {MIN_SECRET_CHARS} random characters"
                    )
                    + f", or unset {name} to run without a cluster secret"
                )
    if value is not None and path is not None:
        raise ConfigError(
            "HETPS_SECRET and HETPS_SECRET_FILE are both set: set only one "
            "(HETPS_SECRET_FILE for roles started by hand)"
        )
    if path is not None:
        value = _read_secret_file(path).strip()
        source = f"HETPS_SECRET_FILE={path}"
        if not value:  # a file was named: an empty one must not turn security off
            raise ConfigError(
                f"{source} is empty (or blank): it must hold the cluster secret, at least "
                f"{MIN_SECRET_CHARS} random characters; `hetps secret FILE` writes one (to run "
                "unauthenticated instead, unset HETPS_SECRET_FILE)"
            )
    else:
        source = "HETPS_SECRET"
    if not value:
        return None, insecure
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{source} holds a secret of {len(value)} characters: use at least "
            f"{MIN_SECRET_CHARS} random characters; `hetps secret FILE` writes a new one"
        )
    if insecure:
        raise ConfigError(
            f"HETPS_INSECURE=1 and a cluster secret ({source}) are both set: unset "
            "HETPS_INSECURE to use the secret, or unset the secret to run unauthenticated"
        )
    return value.encode(), insecure


def _read_secret_file(path: str) -> str:
    # the type first: opening a FIFO (or a device) for reading would wait for a writer,
    # and the role would hang before it said why; O_NONBLOCK covers a swap after the check
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        st = None  # (the open below says why, with the fix)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError(_not_regular(path, st.st_mode))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(
            f"HETPS_SECRET_FILE={path}: cannot open it ({exc.strerror}); make one with "
            f"`hetps secret {path}` and give every role of the job the same file"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(_not_regular(path, st.st_mode))
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"HETPS_SECRET_FILE={path} belongs to uid {st.st_uid}, not to uid "
                f"{os.getuid()} who runs this role: a secret file must be the role's own "
                f"user's (copy it: cp {path} NEW && chmod 600 NEW, as uid {os.getuid()}, and "
                "set HETPS_SECRET_FILE=NEW)"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"HETPS_SECRET_FILE={path} is open to others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}): a secret must be "
                f"readable by its owner alone: chmod 600 {path} (as uid {os.getuid()})"
            )
        with os.fdopen(fd, "r", closefd=False) as f:
            return f.read(4096)
    finally:
        os.close(fd)


def _not_regular(path: str, mode: int) -> str:
    kinds = [
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    kind = next((text for test, text in kinds if test(mode)), "not a regular file")
    return (
        f"HETPS_SECRET_FILE={path} is {kind}, not a regular file: a secret file must be a "
        f"plain file of its owner alone; `hetps secret FILE` writes one (mode 0600)"
    )


def check_exposure(
    secret: bytes | None, insecure: bool, addresses: list[str], role: str = "node"
) -> None:
    """Refuse plain mode (no secret) on a non-loopback address unless HETPS_INSECURE=1."""
    if secret is not None or insecure:
        return
    exposed = [a for a in addresses if not is_loopback(a)]
    if exposed:
        raise ConfigError(
            f"this {role} would accept connections on {exposed[0]} without a cluster secret, "
            "so anybody who can reach it could join, push to, run code on or stop the job. "
            "Give every role the same secret: set HETPS_SECRET_FILE to a file made by "
            "`hetps secret FILE` (mode 0600, copied to every host), or use `hetps launch`, "
            "which makes one for each job. To run unauthenticated anyway (not recommended), "
            "set HETPS_INSECURE=1"
        )
