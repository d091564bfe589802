"""The one place where hetps reads environment variables: every variable, in one table.

Each :class:`Var` row says a variable's name (and MXNet/ps-lite aliases), the
:class:`NodeConfig` field it fills, its type, default, bounds and what it means. From the
table come the parser (:func:`node_config_from_env`, :func:`env_value`), its errors (a
:class:`ConfigError` names the variable and the fix), :class:`NodeConfig` itself, the
reference ``docs/CONFIG.md`` (:func:`markdown`) and ``hetps config`` (:func:`report`), which
lists every variable with its value and where the value came from.

Code elsewhere never reads ``os.environ`` for configuration; it asks this module
(``tests/unit/test_config.py`` holds it to that).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
import os
import socket
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("scheduler", "server", "worker")
BALANCE_SCHEMES = ("none", "average", "elastic", "aware", "optimal")
LOOPBACK = ("127.0.0.1", "localhost")
#: the shortest cluster secret accepted (``hetps secret`` and ``hetps launch`` make 64)
MIN_SECRET_CHARS = 32


class ConfigError(ValueError):
    """A configuration variable is missing or malformed; the message names it and the fix."""


#: A row's ``check``: (its parsed value, every parsed value by variable name) -> the error
#: message, or None when the value is fine. It runs once all rows are parsed, so a rule over
#: two variables lives in one row; a variable it needs that is unset or bad is absent.
Check = Callable[[Any, Mapping[str, Any]], "str | None"]
#: A row's ``derive``: (every parsed value) -> (value, what it came from) for an unset
#: variable whose value follows from others, None when it cannot tell yet; may raise.
Derive = Callable[[Mapping[str, Any]], "tuple[Any, str] | None"]

REQUIRED: Any = dataclasses.MISSING  # a row's default when the variable must be set

_KINDS = {  # kind -> (Python type, how the docs say it, what an error asks for)
    "int": (int, "integer", "an integer"),
    "float": (float, "number", "a number"),
    "str": (str, "string", "a string"),
    "choice": (str, "choice", "one of"),
    "flag": (bool, "0 / 1", "an integer >= 0"),
}


@dataclass(frozen=True)
class Var:
    """One row of the table: an environment variable hetps reads (or sets for others)."""

    name: str
    kind: str  # int, float, str, choice (one of ``choices``), flag (integer > 0 = on)
    default: Any  # REQUIRED: a cluster node needs it set
    meaning: str  # one line a user understands
    field: str | None = None  # the NodeConfig field it fills; None: read by a command
    aliases: tuple[str, ...] = ()  # other names (read after ``name``; the first one set wins)
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    noun: str = ""  # what a choice is called in errors ("a role")
    lower: bool = False  # a choice is case-insensitive
    cap: float | None = None  # values above count as this (not an error)
    unit: str = ""  # bytes, seconds, ... (docs and display)
    expect: str = ""  # what to set it to, in errors (default: from kind and bounds)
    bounds: str = ""  # the docs' bounds column (default: from minimum/maximum/choices)
    default_text: str = ""  # the docs' default column (default: the default)
    check: Check | None = None
    derive: Derive | None = None
    provided: bool = False  # hetps sets it for the commands it starts; it is shown, not parsed
    hidden: bool = False  # a secret: ``hetps config`` says whether it is set, never the value

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def expectation(self) -> str:
        """What the variable should be set to, as an error's fix says it."""
        if self.expect:
            return self.expect
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        what = _KINDS[self.kind][2]
        if self.kind == "flag":
            return "1 (on) or 0 (off)"
        if self.minimum is not None and self.maximum is not None:
            return f"{what} from {self.minimum} to {self.maximum}"
        if self.minimum is not None:
            return f"{what} >= {self.minimum}"
        return what

    def parse(self, raw: str, name: str | None = None) -> Any:
        """The value of ``raw`` (stripped, non-empty) given as ``name`` (default: the row's
        name); raises ConfigError naming the variable and the fix. Cross-variable rules
        (``check``) are not applied here."""
        name = name or self.name
        fix = f"set {name} to {self.expectation()}"
        if self.provided or self.kind == "str":
            return raw
        if self.kind == "choice":
            value = raw.lower() if self.lower else raw
            if value not in self.choices:
                noun = self.noun or "a choice"
                raise ConfigError(f"{name}={value!r} is not {noun}: {fix}")
            return value
        if self.kind == "float":
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if math.isnan(value):
                raise ConfigError(f"{name}={raw!r} is not a number: {fix}") from None
        else:
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer: {fix}") from None
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{name}={value} is below {self.minimum}: {fix}")
        if self.maximum is not None and value > self.maximum:
            raise ConfigError(f"{name}={value} is above {self.maximum}: {fix}")
        if self.cap is not None:
            value = min(value, type(value)(self.cap))
        if self.kind == "flag":
            return value > 0
        return value


# -- rules that involve more than a value's own bounds -----------------------------------------
def _port_check(port: int, values: Mapping[str, Any]) -> str | None:
    if port == 0 and values.get("DMLC_ROLE") != "scheduler":
        return (
            "DMLC_PS_ROOT_PORT=0 is below 1: set DMLC_PS_ROOT_PORT to the scheduler's TCP port "
            "(only a scheduler may take 0, an ephemeral port it reports)"
        )
    return None


def _heartbeat_check(timeout: float, values: Mapping[str, Any]) -> str | None:
    interval = values.get("PS_HEARTBEAT_INTERVAL")
    if interval is not None and interval > 0 and timeout <= interval:
        return (
            f"PS_HEARTBEAT_TIMEOUT={timeout} must exceed PS_HEARTBEAT_INTERVAL={interval}: "
            "raise the timeout (a few intervals) or set PS_HEARTBEAT_INTERVAL=0 to disable heartbeats"
        )
    return None


def _shm_check(size: int, values: Mapping[str, Any]) -> str | None:
    if 0 < size < (1 << 20):
        return (
            f"HETPS_SHM_BYTES={size} is too small for a ring: set at least 1048576 "
            "(1 MiB), or 0 to send every frame over TCP"
        )
    return None


def _metrics_host_check(host: str, values: Mapping[str, Any]) -> str | None:
    if is_loopback(host) or host == values.get("DMLC_PS_ROOT_URI"):
        return None
    return (
        f"HETPS_METRICS_HOST={host!r} is neither a loopback address nor the scheduler's "
        "DMLC_PS_ROOT_URI: set HETPS_METRICS_HOST to 127.0.0.1 (the default) or to "
        "DMLC_PS_ROOT_URI's value to serve metrics on the scheduler's address; the endpoint "
        "never binds every interface"
    )


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


def route_address(host: str, port: int = 9) -> str:
    """This machine's IPv4 address on the route to ``host``: the source address the kernel
    picks for it (a UDP connect sends nothing). The address a flat network (a Kubernetes
    pod network, a Slurm or MPI cluster) reaches this machine at, as the scheduler's peers
    see it. Raises ConfigError when ``host`` does not resolve or has no route."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError as exc:
        raise ConfigError(
            f"cannot find this node's address on the route to the scheduler "
            f"DMLC_PS_ROOT_URI={host!r} ({exc}): set DMLC_NODE_HOST to this node's IP address "
            "(in Kubernetes: env DMLC_NODE_HOST with valueFrom.fieldRef.fieldPath "
            "status.podIP)"
        ) from None


def _derive_node_host(values: Mapping[str, Any]) -> tuple[str, str] | None:
    interface = values.get("DMLC_INTERFACE")
    if interface is not None:
        return interface_address(interface), "derived from DMLC_INTERFACE"
    root_uri = values.get("DMLC_PS_ROOT_URI")
    if root_uri is None:
        return None  # DMLC_PS_ROOT_URI's own error says what to do
    if root_uri in LOOPBACK:
        return "127.0.0.1", "derived from DMLC_PS_ROOT_URI (loopback)"
    if values.get("DMLC_ROLE") == "scheduler":  # it is at DMLC_PS_ROOT_URI by definition
        return root_uri, "derived from DMLC_PS_ROOT_URI (the scheduler's own address)"
    # launchers that place every process themselves and never set DMLC_NODE_HOST (ps-lite
    # then takes the first interface): the address on the route to the scheduler is the one
    # its peers reach this node at
    launcher = None
    if values.get("DMLC_USE_KUBERNETES"):
        launcher = "DMLC_USE_KUBERNETES=1"
    elif values.get("DMLC_JOB_CLUSTER"):
        launcher = f"DMLC_JOB_CLUSTER={values['DMLC_JOB_CLUSTER']}"
    if launcher is not None:
        address = route_address(root_uri, values.get("DMLC_PS_ROOT_PORT") or 9)
        return address, f"derived: the route to DMLC_PS_ROOT_URI ({launcher})"
    raise ConfigError(
        "hetps cannot tell which address this node should advertise: set DMLC_NODE_HOST "
        "to this machine's IP address, or DMLC_INTERFACE to the interface to use "
        "(hetps never picks an interface silently)"
    )


def _derive_launch_rank(values: Mapping[str, Any]) -> tuple[int, str] | None:
    role = values.get("DMLC_ROLE")
    name = {"worker": "DMLC_WORKER_ID", "server": "DMLC_SERVER_ID"}.get(role or "")
    if name is not None and values.get(name) is not None:
        return values[name], f"derived from {name}"
    return None


# -- the table ---------------------------------------------------------------------------------
#: (section, rows). Rows with a ``field`` make :class:`NodeConfig`, in this order (the
#: required ones first). Sections and rows appear in this order in docs/CONFIG.md and
#: ``hetps config``.
# fmt: off
SECTIONS: tuple[tuple[str, tuple[Var, ...]], ...] = (
    (
        "Cluster (the ps-lite / MXNet names)",
        (
            Var("DMLC_ROLE", "choice", REQUIRED, "the role this process plays in the cluster",
                field="role", choices=ROLES, noun="a role"),
            Var("DMLC_PS_ROOT_URI", "str", REQUIRED, "the scheduler's IP address",
                field="root_uri", expect="the scheduler's IP address (e.g. 127.0.0.1)"),
            Var("DMLC_PS_ROOT_PORT", "int", REQUIRED,
                "the scheduler's port (a scheduler given 0 binds a free port and prints it)",
                field="root_port", minimum=0, maximum=65535, check=_port_check,
                expect="a TCP port number from 1 to 65535 (0: a scheduler picks a free one)",
                bounds="1 to 65535 (0 for a scheduler)"),
            Var("DMLC_NUM_SERVER", "int", REQUIRED, "number of servers in the cluster",
                field="num_server", minimum=1),
            Var("DMLC_NUM_WORKER", "int", REQUIRED, "number of workers in the cluster",
                field="num_worker", minimum=1),
            Var("DMLC_NODE_HOST", "str", REQUIRED,
                "the address this node advertises to the others; needed with a non-loopback "
                "scheduler unless DMLC_INTERFACE is set (hetps never picks an interface "
                "silently)",
                field="node_host", derive=_derive_node_host,
                default_text="DMLC_INTERFACE's address; 127.0.0.1 with a loopback scheduler"),
            Var("DMLC_INTERFACE", "str", None,
                "the network interface whose IPv4 address this node advertises when "
                "DMLC_NODE_HOST is not set", field="interface"),
            Var("DMLC_USE_KUBERNETES", "flag", False,
                "set to 1 by Kubeflow's MXJob in every pod: a server or worker without "
                "DMLC_NODE_HOST/DMLC_INTERFACE advertises its address on the route to the "
                "scheduler (the pod's IP); docs/LAUNCHERS.md",
                field="use_kubernetes", minimum=0),
            Var("DMLC_JOB_CLUSTER", "str", None,
                "set by dmlc-core's tracker (local, mpi, slurm, sge, yarn): a server or worker "
                "without DMLC_NODE_HOST/DMLC_INTERFACE advertises its address on the route to "
                "the scheduler; docs/LAUNCHERS.md", field="job_cluster"),
            Var("DMLC_WORKER_ID", "int", None,
                "a worker's index, set by MXJob (Kubeflow training-operator) and dmlc-core's "
                "kubernetes tracker: the rank it asks for unless HETPS_LAUNCH_RANK is set",
                field="worker_id", minimum=0),
            Var("DMLC_SERVER_ID", "int", None,
                "a server's index, set by dmlc-core's kubernetes tracker: the rank it asks for "
                "unless HETPS_LAUNCH_RANK is set (a worker ignores it)",
                field="server_id", minimum=0),
            Var("PS_PORT", "int", 0, "the port this node listens on (0: a free port)",
                field="port", minimum=0),
            Var("PS_VERBOSE", "int", 0,
                "logging: 1 connections (ps-lite style `assign rank=...`), 2 every message",
                field="verbose", minimum=0),
            Var("PS_HEARTBEAT_INTERVAL", "float", 1.0,
                "seconds between heartbeats (0 turns heartbeats off)",
                field="heartbeat_interval", minimum=0.0, unit="seconds"),
            Var("PS_HEARTBEAT_TIMEOUT", "float", 10.0,
                "a node silent this long is declared dead (more than the interval)",
                field="heartbeat_timeout", minimum=0.0, unit="seconds",
                check=_heartbeat_check, bounds="> PS_HEARTBEAT_INTERVAL"),
            Var("HETPS_CONNECT_TIMEOUT", "float", 30.0,
                "time to reach the scheduler and see the cluster complete",
                field="connect_timeout", minimum=0.1, unit="seconds"),
            Var("HETPS_REQUEST_TIMEOUT", "float", 600.0,
                "time any call waits for its answer",
                field="request_timeout", minimum=0.1, unit="seconds"),
        ),
    ),
    (
        "Transport",
        (
            Var("MXNET_KVSTORE_BIGARRAY_BOUND", "int", 1_000_000,
                "arrays of at least this many elements are split evenly over all servers; "
                "smaller ones go whole to one server",
                field="bigarray_bound", aliases=("HETPS_BIGARRAY_BOUND",), minimum=1,
                unit="elements"),
            Var("HETPS_CHUNK_BYTES", "int", 4 << 20,
                "wire chunk size: big arrays travel in pipelined chunks of at most this, so "
                "no buffer grows with the array",
                field="chunk_bytes", minimum=4096, unit="bytes"),
            Var("HETPS_SERVER_THREADS", "int", 0,
                "threads a server sums big pushes and runs the built-in optimizers on (in "
                "cache-sized chunks, the handling thread included; the arithmetic is the same "
                "on any number); 0: the cores the process may use, at most 4",
                field="server_threads", minimum=0),
            Var("HETPS_MAX_MESSAGE_BYTES", "int", 1 << 31, "the largest message a node accepts",
                field="max_message_bytes", minimum=1024, unit="bytes"),
            Var("HETPS_SHM_BYTES", "int", 32 << 20,
                "shared-memory ring (in /dev/shm) to a peer on the same machine, opened the "
                "first time an array of 2 MiB or more (64 KiB with a cluster secret: the "
                "connection is encrypted, the ring is not), or a message whose arrays from "
                "4 KiB reach that (or 1 MiB) together, goes there; one per direction and "
                "pair, skipped if /dev/shm lacks room (0: always TCP)",
                field="shm_bytes", minimum=0, unit="bytes", check=_shm_check,
                bounds="0, or >= 1048576"),
            Var("HETPS_BULK_CHANNELS", "int", 1,
                "with a cluster secret: 1 offers every peer with no shared-memory ring a bulk "
                "channel into this node (arrays from 64 KiB on a second, plain connection, "
                "sealed with AES-256-GCM; docs/SECURITY.md); 0: everything this node receives "
                "comes on its CURVE connection (one port per node)",
                field="bulk_channels", minimum=0, maximum=1),
            Var("HETPS_IO_THREADS", "int", 0,
                "ZeroMQ I/O threads of each server and worker (each connection is served by "
                "one; several peers spread over them); 0: one per 4 cores the process may "
                "use, 1 to 4",
                field="io_threads", minimum=0),
            Var("HETPS_BATCH_BYTES", "int", 1 << 20,
                "requests of a call to one server, and answers ready together for one "
                "worker, travel as one message when each carries at most this many bytes of "
                "arrays (at most 1 MiB counts; 0: every request and answer alone)",
                field="batch_bytes", minimum=0, unit="bytes"),
            Var("HETPS_ROUNDS_AHEAD", "int", 2,
                "dist_sync: how many rounds of one key a worker may push before the oldest "
                "is applied; a further push waits (MXNet's engine allows 1)",
                field="rounds_ahead", minimum=1),
            Var("HETPS_REPLICAS", "int", 1,
                "dist_sync: copies of every key, each on its own server (read by the "
                "scheduler); a server applies each round on the next REPLICAS-1 servers "
                "before it acknowledges, and when it dies the next one takes over its keys "
                "without a restart (1: no copies; at most DMLC_NUM_SERVER)",
                field="replicas", minimum=1),
            Var("HETPS_SHAPE_MBIT", "float", 0.0,
                "limit this node's sending rate in-process, without root (0: no limit)",
                field="shape_mbit", minimum=0.0, unit="Mbit/s"),
        ),
    ),
    (
        "DistributedOptimizer",
        (
            Var("HETPS_FUSION_BYTES", "int", 1 << 18,
                "gradients below this travel fused with their neighbours, in groups up to "
                "this size (0: every parameter alone)",
                field="fusion_bytes", minimum=0, unit="bytes"),
            Var("HETPS_FUSION_TUNE_STEPS", "int", 4,
                "on a synchronous store: steps timed before the fusion groups are re-made to "
                "follow backward's pauses (0: keep the size-only groups)",
                field="fusion_tune_steps", minimum=0),
        ),
    ),
    (
        "Security (docs/SECURITY.md)",
        (
            Var("HETPS_SECRET", "str", None,
                "the cluster secret: every connection is authenticated and encrypted "
                "(CurveZMQ) with keys derived from it; `hetps launch` makes a fresh one per "
                "job and hands it to every process it starts",
                hidden=True, bounds=f">= {MIN_SECRET_CHARS} characters",
                default_text="not set (`hetps launch` sets one)"),
            Var("HETPS_SECRET_FILE", "str", None,
                "a file (mode 0600, owner only) holding the cluster secret, for roles started "
                "by hand; `hetps secret FILE` writes one"),
            Var("HETPS_INSECURE", "flag", False,
                "run without a secret on a non-loopback address (unauthenticated, "
                "unencrypted; warned about at every start)", field="insecure", minimum=0),
        ),
    ),
    (
        "Read by hetps commands",
        (
            Var("HETPS_SSH", "str", "ssh", "the ssh program `hetps launch --launcher ssh` runs"),
            Var("RAY_ADDRESS", "str", None,
                "the Ray cluster `hetps launch --launcher ray` joins when --ray-address is not "
                "given (Ray's own variable); not set: a local Ray is started for the job",
                default_text="not set: a local Ray for the job"),
            Var("OMP_NUM_THREADS", "int", None,
                "intra-op threads (OpenMP, torch, OpenBLAS, MKL) of each process. Not set: "
                "`hetps launch` and `hetps train --workers` give every worker they start "
                "cores // processes on its host (at least 1) and every server and the "
                "scheduler 1, so a cluster on one machine does not oversubscribe it; "
                "`hetps train -m local` uses every core, a worker started by hand 1. Set: "
                "passed unchanged to every process (0 counts as 1 in `hetps train`). Not "
                "hetps' own variable",
                minimum=0, default_text="not set: a share of the cores (see meaning)"),
        ),
    ),
    (
        "Set by hetps for the processes it starts",
        (
            Var("HETPS_LAUNCH_RANK", "int", -1,
                "the rank this node asks the scheduler for (-1: in order of arrival)",
                field="launch_rank", minimum=-1, derive=_derive_launch_rank,
                default_text="DMLC_WORKER_ID / DMLC_SERVER_ID of its role; else -1"),
            Var("HETPS_LAUNCHER_TOKEN", "str", "",
                "set by `hetps launch` in its scheduler's environment alone: the scheduler's "
                "lines to the launcher carry it, and the launcher acts on no other line",
                field="launcher_token"),
            Var("HETPS_RESTART", "int", 0,
                "set by `hetps launch --max-restarts` for every process of a job it started "
                "again: the restart's number (0: the first start); `hetps train` then resumes "
                "from its --checkpoint-dir", field="restart", minimum=0),
            Var("HETPS_ELASTIC", "int", 0,
                "`--elastic MIN`: a worker that dies is let go and the job goes on with the "
                "others without a restart (dist_sync rounds it had not completed finish "
                "without it), while at least MIN remain (0: off). Read by the scheduler",
                field="elastic", minimum=0),
            Var("HETPS_PORT_FILE", "str", None,
                "a file the scheduler writes the port it bound to", field="port_file"),
            Var("HETPS_NETEM_SCENARIO", "str", None,
                "the scenario file of `--netem`, set for every node; `hetps train` records "
                "it with the run"),
            Var("HETPS_NETEM_NODE", "int", None,
                "the emulated node's index (`hetps netem`, `--netem`)", provided=True),
            Var("HETPS_NETEM_IP", "str", None, "the emulated node's address (`hetps netem`)",
                provided=True),
            Var("HETPS_NETEM_NODES", "int", None, "the number of emulated nodes (`hetps netem`)",
                provided=True),
            Var("HETPS_NETEM_IPS", "str", None,
                "every emulated node's address, by index, comma-separated (`hetps netem`)",
                provided=True),
        ),
    ),
    (
        "Load balance (docs/BALANCE.md)",
        (
            Var("HETPS_BALANCE", "choice", "none",
                "the network-aware load distribution scheme (none: MXNet's hash placement)",
                field="balance", choices=BALANCE_SCHEMES, noun="a scheme", lower=True),
            Var("HETPS_SLICE_ELEMS", "int", 1 << 16, "elements per slice when balancing",
                field="slice_elems", minimum=16, unit="elements"),
            Var("HETPS_PROBE_NUM", "int", 1,
                "probe slices each idle server gets, so its link keeps being measured",
                field="probe_num", minimum=0),
            Var("HETPS_PROBE_BYTES", "int", 128 * 1024, "size of one bandwidth probe",
                field="probe_bytes", minimum=16, unit="bytes"),
            Var("HETPS_PROBE_PROB", "float", 0.25,
                "aware/optimal: the workers probe the links every round(1/p)-th round "
                "(0: never)",
                field="probe_prob", minimum=0.0, cap=1.0, bounds=">= 0.0 (above 1 counts as 1)"),
            Var("HETPS_REPLAN_EVERY", "int", 1, "rounds between re-plans",
                field="replan_every", minimum=1),
            Var("HETPS_REPLAN_MARGIN", "float", 0.10,
                "keep the current plan unless a new one is predicted this much faster "
                "(0.1: 10%)", field="replan_margin", minimum=0.0),
            Var("HETPS_PUSH_WINDOW", "int", 1 << 19,
                "bytes of pushes a worker keeps in flight when balancing (0: no window)",
                field="push_window", minimum=0, unit="bytes"),
            Var("HETPS_COLOCATE", "flag", False,
                "one server beside each worker (server r on worker r's node); `--colocate` "
                "sets it", field="colocate", minimum=0),
        ),
    ),
    (
        "Live metrics (docs/LIVE.md)",
        (
            Var("HETPS_METRICS_PORT", "int", None,
                "the scheduler serves Prometheus metrics over HTTP on this port (0: a free "
                "port, printed as `hetps metrics http://HOST:PORT/metrics`); `--metrics-port` "
                "sets it", field="metrics_port", minimum=0, maximum=65535,
                default_text="not set (no endpoint)"),
            Var("HETPS_METRICS_HOST", "str", "127.0.0.1",
                "the address the metrics endpoint binds: loopback, or the scheduler's own "
                "DMLC_PS_ROOT_URI when named here (never every interface)",
                field="metrics_host", check=_metrics_host_check,
                bounds="a loopback address or DMLC_PS_ROOT_URI"),
            Var("HETPS_METRICS_INTERVAL", "float", 1.0,
                "seconds between a worker's metrics reports to the scheduler (the scheduler "
                "tells its workers when its endpoint is on)",
                field="metrics_interval", minimum=0.05, maximum=3600.0, unit="seconds"),
        ),
    ),
)
# fmt: on

VARS: tuple[Var, ...] = tuple(v for _, rows in SECTIONS for v in rows)
BY_NAME: dict[str, Var] = {n: v for v in VARS for n in v.names}
NODE_VARS: tuple[Var, ...] = tuple(v for v in VARS if v.field)


def _make_node_config() -> type:
    fields = []
    for v in sorted(NODE_VARS, key=lambda v: not v.required):  # required ones first
        typ = _KINDS[v.kind][0]
        annotation = typ if v.default is not None else typ | None
        if v.required:
            fields.append((v.field, annotation))
        else:
            fields.append((v.field, annotation, dataclasses.field(default=v.default)))

    # the secret is no row's field: it comes from HETPS_SECRET or HETPS_SECRET_FILE, and a
    # repr (a log line, a traceback) never shows it
    fields.append(("secret", bytes | None, dataclasses.field(default=None, repr=False)))

    def scheduler_endpoint(self) -> str:
        """The scheduler's ZeroMQ endpoint, ``tcp://host:port``."""
        return f"tcp://{self.root_uri}:{self.root_port}"

    doc = "How one process joins a hetps cluster; fields from the variables:\n\n" + "\n".join(
        f"* ``{v.field}``: ``{v.name}``, {v.meaning}" for v in NODE_VARS
    )
    cls = dataclasses.make_dataclass(
        "NodeConfig",
        fields,
        frozen=True,
        namespace={"scheduler_endpoint": property(scheduler_endpoint), "__doc__": doc},
    )
    cls.__module__ = __name__
    return cls


#: How one process joins a hetps cluster: a frozen dataclass made from the table's rows
#: with a ``field`` (``root_uri``, ``num_server``, ``shm_bytes``, ...) plus
#: ``scheduler_endpoint``.
NodeConfig = _make_node_config()


# -- resolving against an environment ----------------------------------------------------------
@dataclass
class Setting:
    """One variable resolved against an environment."""

    var: Var
    value: Any = None  # None: not set (and no default)
    source: str = "default"  # default, environment, environment (ALIAS), derived from X, ...
    raw: str | None = None
    problem: str | None = None  # the error a node would report
    missing: bool = False  # a required variable that is not set


def _raw(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _read(var: Var, env: Mapping[str, str]) -> Setting:
    """Parse one row on its own (no derivation, no cross-variable check)."""
    found: Setting | None = None
    for name in var.names:  # the first name set wins; a malformed one is an error anyway
        raw = _raw(env, name)
        if raw is None:
            continue
        source = "environment" if name == var.name else f"environment ({name})"
        try:
            value = var.parse(raw, name)
        except ConfigError as exc:
            return Setting(var, None, source, raw, problem=str(exc))
        if var.cap is not None and float(raw) > var.cap:
            source += f" (capped at {var.cap:g})"
        found = found or Setting(var, value, source, raw)
    if found is not None:
        return found
    if var.required and var.derive is None:
        problem = f"{var.name} is not set: set {var.name} to {var.expectation()}"
        return Setting(var, None, "not set", problem=problem, missing=True)
    if var.required or var.default is None or var.derive is not None:
        return Setting(var, None, "not set")  # a derived row's default comes after derive
    return Setting(var, var.default, "default")


def resolve(
    env: Mapping[str, str] | None = None,
    role: str | None = None,
    rows: Iterable[Var] = VARS,
) -> dict[str, Setting]:
    """Every row of ``rows`` resolved against ``env`` (default ``os.environ``), by name.

    ``role``, when given, stands for ``DMLC_ROLE``. A setting's ``problem`` is the error a
    node would report for it; nothing is raised here.
    """
    env = os.environ if env is None else env
    rows = tuple(rows)
    out: dict[str, Setting] = {}
    for var in rows:
        if var.name == "DMLC_ROLE" and role:
            out[var.name] = _read(var, {"DMLC_ROLE": role})
            out[var.name].source = "command"
        else:
            out[var.name] = _read(var, env)
    values = {n: s.value for n, s in out.items() if s.problem is None and s.value is not None}
    for var in rows:
        s = out[var.name]
        if var.derive is not None and s.value is None and s.problem is None:
            try:
                derived = var.derive(values)
            except ConfigError as exc:
                s.problem = str(exc)
            else:
                if derived is not None:
                    s.value, s.source = derived
                    values[var.name] = s.value
                elif not var.required and var.default is not None:
                    s.value, s.source = var.default, "default"
                    values[var.name] = s.value
    for var in rows:
        s = out[var.name]
        if var.check is not None and s.problem is None and s.value is not None:
            s.problem = var.check(s.value, values)
    return out


def _join_error(settings: Iterable[Setting]) -> ConfigError | None:
    problems = [s.problem for s in settings if s.problem]
    if not problems:
        return None
    return ConfigError("hetps cannot join the cluster:\n  " + "\n  ".join(problems))


def node_config_from_env(env: Mapping[str, str] | None = None, role: str | None = None):
    """Parse a :class:`NodeConfig` from ``env`` (default ``os.environ``).

    ``role`` overrides ``DMLC_ROLE``. Raises :class:`ConfigError` listing every missing or
    malformed variable with the fix.
    """
    env = os.environ if env is None else env
    settings = resolve(env, role, NODE_VARS)
    error = _join_error(settings.values())
    if error is not None:
        raise error
    values = {v.field: settings[v.name].value for v in NODE_VARS}
    _check_replicas(values)
    secret, values["insecure"] = security_from_env(env)
    # the scheduler listens on DMLC_PS_ROOT_URI (every interface unless it is loopback),
    # the others on their own address
    role = values["role"]
    check_exposure(
        secret,
        values["insecure"],
        [values["root_uri"]] if role == "scheduler" else [values["root_uri"], values["node_host"]],
        role,
    )
    return NodeConfig(**values, secret=secret)


def _check_replicas(values: dict) -> None:
    """HETPS_REPLICAS against the settings it depends on: one error line with the fix."""
    r = values["replicas"]
    if r <= 1:
        return
    if r > values["num_server"]:
        raise ConfigError(
            f"HETPS_REPLICAS={r} asks for more copies of each key than there are servers "
            f"(DMLC_NUM_SERVER={values['num_server']}): use at most {values['num_server']}, "
            "or start more servers"
        )


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1), or a name every address
    of which is one (``localhost``, as resolved). Decided by the address, never by how a name
    is spelled: ``127.example.com`` is whatever it resolves to; a name that does not resolve
    is not loopback."""
    text = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        pass
    if not text or text in ("*", "0.0.0.0"):
        return False
    try:
        infos = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addrs = {info[4][0] for info in infos}
    try:
        return bool(addrs) and all(
            ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs
        )
    except ValueError:
        return False


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
    value = _raw(env, "HETPS_SECRET")
    path = _raw(env, "HETPS_SECRET_FILE")
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


def env_value(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of variable ``name`` (a table row) in ``env`` (default ``os.environ``): its
    default when unset, None when it has none. Raises ConfigError for a malformed value."""
    var = BY_NAME[name]
    setting = _read(var, os.environ if env is None else env)
    if setting.problem is None and var.check is not None and setting.value is not None:
        setting.problem = var.check(setting.value, {var.name: setting.value})
    if setting.problem is not None and not setting.missing:
        raise ConfigError(setting.problem)
    return setting.value


def user_threads(extra: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None):
    """The ``OMP_NUM_THREADS`` the user set, as given (not parsed: a launcher forwards it
    unchanged), from ``extra`` (e.g. ``--env`` pairs) or else ``env`` (default
    ``os.environ``); None when neither sets it (a launcher then picks each process's share)."""
    for source in (extra or {}, os.environ if env is None else env):
        raw = _raw(source, "OMP_NUM_THREADS")
        if raw is not None:
            return raw
    return None


def role_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """Return ``DMLC_ROLE`` if set (validated), else None (a single-process run)."""
    return env_value("DMLC_ROLE", env)
