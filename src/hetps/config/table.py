"""The table: every variable hetps reads, in sections (:data:`SECTIONS`), with the rules that
involve more than a value's own bounds (a row's ``check``) and the values that follow from
others (a row's ``derive``). docs/CONFIG.md and ``hetps config`` list it in this order."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hetps.config.addresses import interface_address, is_loopback, resolved, route_address
from hetps.config.rows import REQUIRED, ConfigError, Var

ROLES = ("scheduler", "server", "worker")
#: the module whose import hands config a registry's names -> those names, once loaded
_registries: dict[str, Callable[[], Sequence[str]]] = {}


def _registry(module: str) -> tuple[str, ...]:
    """The names a registry lists: config's code imports nothing below it, so where
    ``module`` (whose import hands config its names) is not loaded yet, config loads it by
    name: a value is checked the same way wherever config is read."""
    if module not in _registries:
        importlib.import_module(module)
    return tuple(_registries[module]())


def use_plan_registry(names: Callable[[], Sequence[str]]) -> None:
    """Read ``HETPS_BALANCE``'s plans from ``names`` (set by :mod:`hetps.balance` on import)."""
    _registries["hetps.balance"] = names


def balance_schemes() -> tuple[str, ...]:
    """``HETPS_BALANCE``'s values: none and every registered plan."""
    return ("none", *_registry("hetps.balance"))


def use_optimizer_registry(names: Callable[[], Sequence[str]]) -> None:
    """Read ``HETPS_OPTIMIZERS``' names from ``names`` (set by :mod:`hetps.optim` on import)."""
    _registries["hetps.optim"] = names


def optimizer_choices() -> tuple[str, ...]:
    """``HETPS_OPTIMIZERS``' values: any, registered and every registered optimizer's name."""
    return ("any", "registered", *_registry("hetps.optim"))


def optimizer_names(text: str) -> frozenset[str] | None:
    """The names ``HETPS_OPTIMIZERS=text`` lets a server take; None for ``any`` (a set
    holding ``registered`` takes every class registered in the server's process)."""
    names = frozenset(n.strip().lower() for n in text.split(","))
    return None if "any" in names else names


def _optimizers_check(text: str, values: Mapping[str, Any]) -> str | None:
    names, known = optimizer_names(text) or frozenset(), optimizer_choices()
    wrong = sorted(n for n in names if n not in known)
    if wrong:
        return (
            f"HETPS_OPTIMIZERS names {', '.join(map(repr, wrong))}, not a registered "
            f"optimizer: set it to registered (the default), any, or a comma list of "
            f"{', '.join(known[2:])}"
        )
    return None


LOOPBACK = ("127.0.0.1", "localhost")
#: the largest host group a node table carries (int32)
MAX_GROUP = (1 << 31) - 1
#: the shortest cluster secret accepted (``hetps secret`` and ``hetps launch`` make 64)
MIN_SECRET_CHARS = 32


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


def _replicas_check(copies: int, values: Mapping[str, Any]) -> str | None:
    servers = values.get("DMLC_NUM_SERVER")
    if copies > 1 and servers is not None and copies > servers:
        return (
            f"HETPS_REPLICAS={copies} asks for more copies of each key than there are servers "
            f"(DMLC_NUM_SERVER={servers}): use at most {servers}, or start more servers"
        )
    return None


def _shm_check(size: int, values: Mapping[str, Any]) -> str | None:
    if 0 < size < (1 << 20):
        return (
            f"HETPS_SHM_BYTES={size} is too small for a ring: set at least 1048576 "
            "(1 MiB), or 0 to send every frame over TCP"
        )
    return None


def _message_check(size: int, values: Mapping[str, Any]) -> str | None:
    chunk = values.get("HETPS_CHUNK_BYTES", 4 << 20)
    rows = values.get("HETPS_TABLE_PULL_BYTES", 16 << 20)
    need = max(chunk, rows) + (64 << 10)
    if size < need:
        return (
            f"HETPS_MAX_MESSAGE_BYTES={size} is below the {need} bytes one message may carry "
            f"(a chunk of HETPS_CHUNK_BYTES={chunk} or a table pull's rows of "
            f"HETPS_TABLE_PULL_BYTES={rows}, and its header): set it to at least {need} on "
            "every node, or lower those"
        )
    return None


def _server_device_check(device: str, values: Mapping[str, Any]) -> str | None:
    text = device.strip().lower()
    index = text[5:] if text.startswith("cuda:") else ""
    if text not in ("cpu", "cuda", "torch:cpu") and not index.isdigit():
        return (
            f"HETPS_SERVER_DEVICE={device!r} is not a device: set it to cpu (the default), "
            "cuda or cuda:N (N the index of a GPU on each server machine)"
        )
    if text == "cpu":
        return None
    for name, value, off, feature in (
        ("HETPS_REPLICAS", values.get("HETPS_REPLICAS", 1), 1, "copies of keys (--replicas)"),
        ("HETPS_ELASTIC", values.get("HETPS_ELASTIC", 0), 0, "workers let go (--elastic)"),
    ):
        if value != off:
            return (
                f"HETPS_SERVER_DEVICE={device} with {name}={value}: {feature} are not built "
                f"for servers on a device; set HETPS_SERVER_DEVICE=cpu or {name}={off}"
            )
    return None


def unspecified(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, ``*``, empty, or a name
    or short form such as ``0`` that resolves to one of these)."""
    # (a name, or a short form such as "0", that resolves to every interface counts)
    return host.strip().strip("[]") in ("", "*") or any(a.is_unspecified for a in resolved(host))


def _metrics_host_check(host: str, values: Mapping[str, Any]) -> str | None:
    if not unspecified(host) and (is_loopback(host) or host == values.get("DMLC_PS_ROOT_URI")):
        return None
    if unspecified(host):
        return (
            f"HETPS_METRICS_HOST={host!r} means every interface, and the endpoint never binds "
            "every interface (even when DMLC_PS_ROOT_URI says so): set HETPS_METRICS_HOST to "
            "127.0.0.1 (the default) or to the scheduler's own IP address or host name"
        )
    return (
        f"HETPS_METRICS_HOST={host!r} is neither a loopback address nor the scheduler's "
        "DMLC_PS_ROOT_URI: set HETPS_METRICS_HOST to 127.0.0.1 (the default) or to "
        "DMLC_PS_ROOT_URI's value to serve metrics on the scheduler's address; the endpoint "
        "never binds every interface"
    )


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


def _derive_host_group(values: Mapping[str, Any]) -> tuple[int, str] | None:
    if values.get("GROUP_RANK") is not None and values["GROUP_RANK"] >= 0:
        return values["GROUP_RANK"], "derived from GROUP_RANK"
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
            Var("HETPS_SERVER_DEVICE", "str", "cpu",
                "where a server sums pushes and runs SGD and Adam: cpu (NumPy, in host "
                "memory), or cuda / cuda:N (torch on that GPU of each server machine; plain "
                "cuda: the GPU of the server's LOCAL_RANK modulo the machine's GPUs, GPU 0 "
                "without one: the "
                "weights and optimizer state live there, each round's value is copied back "
                "once for the pulls; docs/ESYNC.md, 'Servers on a GPU'); `--server-device`",
                field="server_device", check=_server_device_check,
                bounds="cpu, cuda, cuda:N"),
            Var("HETPS_OPTIMIZERS", "str", "registered",
                "the optimizers a server takes from its workers (set_optimizer): registered "
                "(every class registered with @optimizer(\"name\") in the server's process), "
                "or a comma list of registered names: their classes by reference, and from "
                "load_optimizer_states NumPy arrays and numbers only (any other pickle is "
                "refused before it runs); any: any Optimizer subclass, its class pickled by "
                "value (unpickling runs the worker's code)",
                field="optimizers", check=_optimizers_check, choices=optimizer_choices),
            Var("HETPS_MAX_MESSAGE_BYTES", "int", 1 << 31,
                "the largest message a node accepts (batches of small requests are cut to fit)",
                field="max_message_bytes", minimum=1024, unit="bytes", check=_message_check,
                bounds=">= 64 KiB over HETPS_CHUNK_BYTES and HETPS_TABLE_PULL_BYTES"),
            Var("HETPS_SHM_BYTES", "int", 32 << 20,
                "shared-memory ring (in /dev/shm) to a peer on the same machine, opened the "
                "first time an array of 2 MiB or more (4 KiB with a cluster secret: the "
                "connection is encrypted, the ring is not), or a message whose arrays from "
                "4 KiB reach that (or 1 MiB) together, goes there; one per direction and "
                "pair, skipped if /dev/shm lacks room (0: always TCP)",
                field="shm_bytes", minimum=0, unit="bytes", check=_shm_check,
                bounds="0, or >= 1048576"),
            Var("HETPS_BULK_CHANNELS", "int", -1,
                "with a cluster secret: 1 offers every peer with no shared-memory ring a bulk "
                "channel into this node (arrays from 512 KiB on a second, plain connection, "
                "sealed with AES-256-GCM: 1.8-2.1x faster between hosts; a connection must "
                "prove it holds an offered channel's key half at its handshake, see "
                "docs/SECURITY.md, 'Bulk channels'); 0: everything this node receives comes "
                "on its CURVE connection; -1 (the default): 1, unless HETPS_BALANCE plans the "
                "job (its link readings are noisier on the channels when the cores are busy: "
                "docs/BALANCE.md)",
                field="bulk_channels", minimum=-1, maximum=1),
            Var("HETPS_KEEP_BUFFERS", "int", 1,
                "1: a server's or worker's process keeps the memory of the message buffers it "
                "freed for the next ones (glibc's malloc serves blocks up to 32 MiB from its "
                "heap and keeps 256 MiB of freed heap; a 16 MiB frame otherwise costs 4,096 "
                "page faults each time: 1.35-1.4x faster 16 MB rounds between hosts, see "
                "docs/PERFORMANCE.md); its resident memory then stays at its peak. 0: malloc "
                "as the process has it (glibc's own MALLOC_* variables also leave it so)",
                field="keep_buffers", minimum=0, maximum=1),
            Var("HETPS_IO_THREADS", "int", 0,
                "ZeroMQ I/O threads of each server and worker (each connection is served by "
                "one; several peers spread over them); 0: one per 4 cores the process may "
                "use, 1 to 4",
                field="io_threads", minimum=0),
            Var("HETPS_BATCH_BYTES", "int", 1 << 20,
                "requests of a call to one server, and answers ready together for one "
                "worker, travel as one message when each carries at most this many bytes of "
                "arrays (at most 1 MiB counts; a table's push and pull and their answers go "
                "whatever their size; 0: every request and answer alone)",
                field="batch_bytes", minimum=0, unit="bytes"),
            Var("HETPS_ROUNDS_AHEAD", "int", 2,
                "dist_sync: how many rounds of one key a worker may push before the oldest "
                "is applied; a further push waits (MXNet's engine allows 1)",
                field="rounds_ahead", minimum=1),
            Var("HETPS_HOST_AGGREGATION", "flag", True,
                "dist_sync: the workers of one host (LOCAL_WORLD_SIZE > 1, HETPS_HOST_GROUP "
                "known) sum their gradients through shared memory and push and pull the "
                "host's sum once (docs/HOSTS.md); 0: every worker pushes and pulls its own",
                field="host_aggregation", minimum=0),
            Var("HETPS_HOST_CONTROL", "flag", True,
                "the workers of one host (HETPS_HOST_GROUP known, more than one worker, a "
                "cluster secret) hand their barrier arrivals to the host's lowest live worker, "
                "which sends one for the host (docs/HOSTS.md); 0: every worker sends its own",
                field="host_control", minimum=0),
            Var("HETPS_TABLE_MAX_BYTES", "int", 0,
                "bytes one server may hold of all its embedding tables (row-sparse keys: "
                "values, optimizer state, id index; a fixed table counts whole, a growing "
                "one its rows made), checked when a table is declared and as it grows; 0: "
                "half of the server machine's memory",
                field="table_max_bytes", minimum=0, unit="bytes",
                default_text="0 (half the memory)"),
            Var("HETPS_TABLE_PULL_BYTES", "int", 16 << 20,
                "bytes of rows one row_sparse_pull request may ask of a server: a worker "
                "splits a bigger pull into requests of at most this, a server refuses one "
                "over it (naming the key, the ids and the bound) before it builds anything, "
                "so a server's memory stays within HETPS_TABLE_MAX_BYTES plus this",
                field="table_pull_bytes", minimum=4096, unit="bytes"),
            Var("HETPS_REPLICAS", "int", 1,
                "dist_sync: copies of every key, each on its own server (read by the "
                "scheduler); a server applies each round on the next REPLICAS-1 servers "
                "before it acknowledges, and when it dies the next one takes over its keys "
                "without a restart (1: no copies; at most DMLC_NUM_SERVER)",
                field="replicas", minimum=1, check=_replicas_check),
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
            Var("HETPS_REFUSAL_LINES", "int", 5,
                "messages and registrations the scheduler refuses that it logs one by one "
                "in each 10-second window; the rest of the window's are counted in one line "
                "(0: a line for every one)", field="refusal_lines", minimum=0),
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
            Var("LOCAL_RANK", "int", -1,
                "torchrun's variable, set by every hetps launcher for a worker: its index "
                "among the workers of its host (a script pins its GPU with it)",
                field="local_rank", minimum=-1, default_text="not set (-1)"),
            Var("LOCAL_WORLD_SIZE", "int", 0,
                "torchrun's variable, set by every hetps launcher for a worker: how many "
                "workers its host runs", field="local_world_size", minimum=0,
                default_text="not set (0)"),
            Var("GROUP_RANK", "int", -1,
                "torchrun's variable, set by every hetps launcher for a worker: its host's "
                "index (the same as HETPS_HOST_GROUP)", field="group_rank", minimum=-1,
                maximum=MAX_GROUP,
                default_text="not set (-1)"),
            Var("RANK", "int", -1,
                "torchrun's variable, set by every hetps launcher for a worker: its launch "
                "rank among the workers (the store's rank once registered)", minimum=-1,
                default_text="not set (-1)"),
            Var("WORLD_SIZE", "int", 0,
                "torchrun's variable, set by every hetps launcher for a worker: the number of "
                "workers (DMLC_NUM_WORKER)", minimum=0, default_text="not set (0)"),
            Var("HETPS_HOST_GROUP", "int", -1,
                "the host (machine) this worker runs on, numbered from 0 by the launcher; "
                "workers with the same group share a host (torchrun's GROUP_RANK). -1: not "
                "known (every worker a host of its own)",
                field="host_group", minimum=-1, maximum=MAX_GROUP, derive=_derive_host_group,
                default_text="GROUP_RANK when set; else -1"),
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
                field="balance", choices=balance_schemes, noun="a scheme", lower=True),
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
            Var("HETPS_GATHER_HOLD_MS", "float", 5.0,
                "the scheduler, in a job whose rounds bring 16 reports or more: after a report "
                "of a round still waiting for others, with nothing queued, wait this long "
                "before reading again, so that the reports coming meanwhile are read together "
                "(0: read each as it comes)",
                field="gather_hold_ms", minimum=0.0, maximum=100.0, unit="ms"),
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
                "DMLC_PS_ROOT_URI when named here (then loopback too, on the same port, where "
                "kubectl port-forward connects); never every interface (0.0.0.0, ::)",
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
