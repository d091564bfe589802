"""The one place where hetps reads environment variables.

Everything a node needs to know about its cluster comes from ``DMLC_*`` (MXNet/ps-lite
compatible), ``PS_*`` and ``HETPS_*`` variables, parsed here into frozen dataclasses.
A missing or malformed variable raises :class:`ConfigError` naming the variable and the fix.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

ROLES = ("scheduler", "server", "worker")

DEFAULT_BIGARRAY_BOUND = 1_000_000
DEFAULT_HEARTBEAT_INTERVAL = 1.0
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
DEFAULT_CONNECT_TIMEOUT = 30.0
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_MESSAGE_BYTES = 1 << 31
DEFAULT_CHUNK_BYTES = 4 << 20
BALANCE_SCHEMES = ("none", "average", "elastic", "aware", "optimal")
#: the shortest cluster secret accepted (``hetps secret`` and ``hetps launch`` make 64)
MIN_SECRET_CHARS = 32


class ConfigError(ValueError):
    """A configuration variable is missing or malformed; the message names it and the fix."""


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int = 0) -> int:
    raw = _get(env, name)
    if raw is None:
        if default is None:
            raise ConfigError(f"{name} is not set: set {name} to an integer >= {minimum}")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not an integer: set {name} to an integer >= {minimum}"
        ) from None
    if value < minimum:
        raise ConfigError(
            f"{name}={value} is below {minimum}: set {name} to an integer >= {minimum}"
        )
    return value


def _float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number: set {name} to a number >= {minimum}"
        ) from None
    if value < minimum:
        raise ConfigError(f"{name}={value} is below {minimum}: set {name} to a number >= {minimum}")
    return value


@dataclass(frozen=True)
class NodeConfig:
    """How one process joins a hetps cluster (read from ``DMLC_*``/``PS_*``/``HETPS_*``)."""

    role: str
    root_uri: str
    root_port: int
    num_server: int
    num_worker: int
    node_host: str
    interface: str | None = None
    verbose: int = 0
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    bigarray_bound: int = DEFAULT_BIGARRAY_BOUND
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    port: int = 0
    port_file: str | None = None
    launch_rank: int = -1  # rank a launcher asks for (HETPS_LAUNCH_RANK); -1 = arrival order
    shape_mbit: float = 0.0  # in-process send-rate limit (HETPS_SHAPE_MBIT); 0 = none
    # network-aware load distribution (docs/BALANCE.md); "none" = MXNet's hash placement
    balance: str = "none"
    slice_elems: int = 1 << 16
    probe_num: int = 1
    probe_bytes: int = 128 * 1024
    probe_prob: float = 0.25
    #: probing rounds may thin out to one in this many times 1/probe_prob while probes keep
    #: agreeing with the plan's link caps (1, the default: every 1/probe_prob-th round);
    #: for networks known to hold still (docs/BALANCE.md §7.5)
    probe_backoff: int = 1
    replan_every: int = 1
    push_window: int = 1 << 19  # bytes of pushes in flight per worker when balancing
    #: pace pushes at this many times the plan's critical push rate (0 = no pacing, the
    #: default: it helped only plans made from the true rates, docs/BALANCE.md §7.1)
    push_pace: float = 0.0
    #: pace every connection of a worker and its servers to this many times its flow's rate
    #: in the plan (its server's share over the predicted iteration time) with the kernel's
    #: SO_MAX_PACING_RATE; 0 = no pacing (docs/BALANCE.md §7.4)
    flow_pace: float = 0.0
    replan_margin: float = 0.10  # keep the plan unless the new one is predicted this much faster
    colocate: bool = False  # one server beside each worker (server rank r on worker r's node)
    # DistributedOptimizer: gradients smaller than this travel fused with their neighbours
    fusion_bytes: int = 1 << 18
    #: steps DistributedOptimizer times before re-making its fusion groups (0 = never)
    fusion_tune_steps: int = 4
    # bytes of each shared-memory ring to a peer on this machine (0: frames always over TCP)
    shm_bytes: int = 32 << 20
    #: the cluster secret (HETPS_SECRET / HETPS_SECRET_FILE): every connection is CURVE-
    #: authenticated and encrypted with keys derived from it; None: plain mode (loopback only)
    secret: bytes | None = field(default=None, repr=False)
    #: HETPS_INSECURE=1: plain mode on a routable address too, warned about at every start
    insecure: bool = False

    @property
    def scheduler_endpoint(self) -> str:
        """The scheduler's ZeroMQ endpoint, ``tcp://host:port``."""
        return f"tcp://{self.root_uri}:{self.root_port}"


def interface_address(name: str) -> str:
    """Return the IPv4 address of network interface ``name`` (Linux), or raise ConfigError."""
    import fcntl
    import socket
    import struct

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(
            sock.fileno(),
            0x8915,
            struct.pack("256s", name[:15].encode()),  # SIOCGIFADDR
        )
    except OSError as exc:
        raise ConfigError(
            f"DMLC_INTERFACE={name!r}: no IPv4 address on that interface ({exc}); "
            "set DMLC_INTERFACE to an interface listed by `ip -4 addr`, or set DMLC_NODE_HOST"
        ) from None
    finally:
        sock.close()
    return socket.inet_ntoa(packed[20:24])


def node_config_from_env(
    env: Mapping[str, str] | None = None, role: str | None = None
) -> NodeConfig:
    """Parse a :class:`NodeConfig` from ``env`` (default ``os.environ``).

    ``role`` overrides ``DMLC_ROLE``. Raises :class:`ConfigError` listing every missing or
    malformed variable with the fix.
    """
    env = os.environ if env is None else env
    problems: list[str] = []
    role = role or _get(env, "DMLC_ROLE")
    if role is None:
        problems.append("DMLC_ROLE is not set: set DMLC_ROLE to one of scheduler, server, worker")
    elif role not in ROLES:
        problems.append(
            f"DMLC_ROLE={role!r} is not a role: set it to one of scheduler, server, worker"
        )
    root_uri = _get(env, "DMLC_PS_ROOT_URI")
    if root_uri is None:
        problems.append(
            "DMLC_PS_ROOT_URI is not set: set it to the scheduler's IP address (e.g. 127.0.0.1)"
        )
    values: dict[str, int] = {}
    # A scheduler may take port 0: it binds an ephemeral port and reports it (HETPS_PORT_FILE).
    port_min = 0 if role == "scheduler" else 1
    for name, minimum in (
        ("DMLC_PS_ROOT_PORT", port_min),
        ("DMLC_NUM_SERVER", 1),
        ("DMLC_NUM_WORKER", 1),
    ):
        try:
            values[name] = _int(env, name, None, minimum)
        except ConfigError as exc:
            problems.append(str(exc))
    if "DMLC_PS_ROOT_PORT" in values and values["DMLC_PS_ROOT_PORT"] > 65535:
        problems.append("DMLC_PS_ROOT_PORT is above 65535: set it to a TCP port number")
    try:
        verbose = _int(env, "PS_VERBOSE", 0)
        interval = _float(env, "PS_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL)
        timeout = _float(env, "PS_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT)
        connect_timeout = _float(env, "HETPS_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT, 0.1)
        request_timeout = _float(env, "HETPS_REQUEST_TIMEOUT", DEFAULT_REQUEST_TIMEOUT, 0.1)
        bound = _int(
            env,
            "MXNET_KVSTORE_BIGARRAY_BOUND",
            _int(env, "HETPS_BIGARRAY_BOUND", DEFAULT_BIGARRAY_BOUND, 1),
            1,
        )
        max_msg = _int(env, "HETPS_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES, 1024)
        chunk = _int(env, "HETPS_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, 4096)
        port = _int(env, "PS_PORT", 0)
        port_file = _get(env, "HETPS_PORT_FILE")
        launch_rank = _int(env, "HETPS_LAUNCH_RANK", -1, -1)
        shape_mbit = _float(env, "HETPS_SHAPE_MBIT", 0.0)
        balance = (_get(env, "HETPS_BALANCE") or "none").lower()
        if balance not in BALANCE_SCHEMES:
            raise ConfigError(
                f"HETPS_BALANCE={balance!r} is not a scheme: set it to one of "
                f"{', '.join(BALANCE_SCHEMES)}"
            )
        slice_elems = _int(env, "HETPS_SLICE_ELEMS", 1 << 16, 16)
        probe_num = _int(env, "HETPS_PROBE_NUM", 1)
        probe_bytes = _int(env, "HETPS_PROBE_BYTES", 128 * 1024, 16)
        probe_prob = _float(env, "HETPS_PROBE_PROB", 0.25)
        probe_backoff = _int(env, "HETPS_PROBE_BACKOFF", 1, 1)
        replan_every = _int(env, "HETPS_REPLAN_EVERY", 1, 1)
        replan_margin = _float(env, "HETPS_REPLAN_MARGIN", 0.10)
        push_window = _int(env, "HETPS_PUSH_WINDOW", 1 << 19, 0)
        push_pace = _float(env, "HETPS_PUSH_PACE", 0.0)
        if push_pace != 0 and not (1 <= push_pace < float("inf")):
            raise ConfigError(
                f"HETPS_PUSH_PACE={push_pace} would hold every worker below the slowest "
                "pusher's rate: set 0 (no pacing, the default) or a margin >= 1, e.g. 1.25"
            )
        if push_pace > 0 and push_window == 0:
            raise ConfigError(
                f"HETPS_PUSH_PACE={push_pace} paces pushes through the credit window, which "
                "HETPS_PUSH_WINDOW=0 turns off: set HETPS_PUSH_WINDOW > 0 (default 524288) "
                "or HETPS_PUSH_PACE=0"
            )
        flow_pace = _float(env, "HETPS_FLOW_PACE", 0.0)
        if flow_pace != 0 and not (0.5 <= flow_pace <= 2.0):
            raise ConfigError(
                f"HETPS_FLOW_PACE={flow_pace} is not a pacing factor: set 0 (no pacing) or a "
                "factor on the plan's flow rates between 0.5 and 2, e.g. 0.95"
            )
        colocate = _int(env, "HETPS_COLOCATE", 0) > 0
        fusion_bytes = _int(env, "HETPS_FUSION_BYTES", 1 << 18, 0)
        fusion_tune_steps = _int(env, "HETPS_FUSION_TUNE_STEPS", 4, 0)
        shm_bytes = _int(env, "HETPS_SHM_BYTES", 32 << 20, 0)
        if 0 < shm_bytes < (1 << 20):
            raise ConfigError(
                f"HETPS_SHM_BYTES={shm_bytes} is too small for a ring: set at least 1048576 "
                "(1 MiB), or 0 to send every frame over TCP"
            )
    except ConfigError as exc:
        problems.append(str(exc))
        verbose, interval, timeout, connect_timeout, request_timeout = 0, 0.0, 0.0, 0.0, 0.0
        bound, max_msg, chunk, port, port_file, launch_rank, shape_mbit = 0, 0, 0, 0, None, -1, 0.0
        balance, slice_elems, probe_num, probe_bytes, probe_prob = "none", 0, 0, 0, 0.0
        probe_backoff = 1
        replan_every, colocate, replan_margin, push_window, push_pace = 1, False, 0.0, 0, 0.0
        flow_pace = 0.0
        fusion_bytes, shm_bytes, fusion_tune_steps = 0, 0, 0
    if not problems and interval > 0 and timeout <= interval:
        problems.append(
            f"PS_HEARTBEAT_TIMEOUT={timeout} must exceed PS_HEARTBEAT_INTERVAL={interval}: "
            "raise the timeout (a few intervals) or set PS_HEARTBEAT_INTERVAL=0 to disable heartbeats"
        )
    if problems:
        raise ConfigError("hetps cannot join the cluster:\n  " + "\n  ".join(problems))
    interface = _get(env, "DMLC_INTERFACE")
    host = _get(env, "DMLC_NODE_HOST")
    if host is None:
        if interface is not None:
            host = interface_address(interface)
        elif root_uri in ("127.0.0.1", "localhost"):
            host = "127.0.0.1"
        else:
            raise ConfigError(
                "hetps cannot tell which address this node should advertise: set DMLC_NODE_HOST "
                "to this machine's IP address, or DMLC_INTERFACE to the interface to use "
                "(hetps never picks an interface silently)"
            )
    secret, insecure = security_from_env(env)
    # the scheduler listens on DMLC_PS_ROOT_URI (every interface unless it is loopback),
    # the others on their own address
    check_exposure(
        secret,
        insecure,
        [root_uri] if role == "scheduler" else [root_uri, host],
        role,  # type: ignore[list-item]
    )
    return NodeConfig(
        role=role,  # type: ignore[arg-type]
        root_uri=root_uri,  # type: ignore[arg-type]
        root_port=values["DMLC_PS_ROOT_PORT"],
        num_server=values["DMLC_NUM_SERVER"],
        num_worker=values["DMLC_NUM_WORKER"],
        node_host=host,
        interface=interface,
        verbose=verbose,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        connect_timeout=connect_timeout,
        request_timeout=request_timeout,
        bigarray_bound=bound,
        max_message_bytes=max_msg,
        chunk_bytes=chunk,
        port=port,
        port_file=port_file,
        launch_rank=launch_rank,
        shape_mbit=shape_mbit,
        balance=balance,
        slice_elems=slice_elems,
        probe_num=probe_num,
        probe_bytes=probe_bytes,
        probe_prob=min(1.0, probe_prob),
        probe_backoff=probe_backoff,
        replan_every=replan_every,
        replan_margin=replan_margin,
        push_window=push_window,
        push_pace=push_pace,
        flow_pace=flow_pace,
        fusion_bytes=fusion_bytes,
        fusion_tune_steps=fusion_tune_steps,
        shm_bytes=shm_bytes,
        colocate=colocate,
        secret=secret,
        insecure=insecure,
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, localhost)."""
    return host.startswith("127.") or host in ("localhost", "::1")


def security_from_env(env: Mapping[str, str] | None = None) -> tuple[bytes | None, bool]:
    """The cluster secret and the HETPS_INSECURE opt-out: ``(secret or None, insecure)``.

    The secret comes from ``HETPS_SECRET`` (the secret itself; ``hetps launch`` hands it to
    every process it starts this way) or ``HETPS_SECRET_FILE`` (a file holding it, readable
    by its owner alone, as ``hetps secret FILE`` writes it). Raises :class:`ConfigError` when
    both are set, when the file is missing or open to others, when the secret is too short,
    or when ``HETPS_INSECURE=1`` comes with a secret.
    """
    env = os.environ if env is None else env
    value = env.get("HETPS_SECRET")
    path = _get(env, "HETPS_SECRET_FILE")
    insecure = _int(env, "HETPS_INSECURE", 0) > 0
    if value is not None and path is not None:
        raise ConfigError(
            "HETPS_SECRET and HETPS_SECRET_FILE are both set: set only one "
            "(HETPS_SECRET_FILE for roles started by hand)"
        )
    if path is not None:
        value = _read_secret_file(path)
        source = f"HETPS_SECRET_FILE={path}"
    else:
        source = "HETPS_SECRET"
    if value is None:
        return None, insecure
    value = value.strip()
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
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ConfigError(
            f"HETPS_SECRET_FILE={path}: cannot open it ({exc.strerror}); make one with "
            f"`hetps secret {path}` and give every role of the job the same file"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"HETPS_SECRET_FILE={path} is not a regular file")
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(
                f"HETPS_SECRET_FILE={path} is open to others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}): a secret must be "
                f"readable by its owner alone: chmod 600 {path} (as uid {os.getuid()})"
            )
        with os.fdopen(fd, "r", closefd=False) as f:
            return f.read(4096)
    finally:
        os.close(fd)


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


def role_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """Return ``DMLC_ROLE`` if set (validated), else None (a single-process run)."""
    env = os.environ if env is None else env
    role = _get(env, "DMLC_ROLE")
    if role is not None and role not in ROLES:
        raise ConfigError(
            f"DMLC_ROLE={role!r} is not a role: set it to one of scheduler, server, worker"
        )
    return role
