"""The ports of the cluster's hosts: what a part may use of the Node or the Scheduler it
belongs to, named here once, so that a part takes its port and not the whole host.

A part's connections come through its own port, :class:`~hetps.transport.links.PeerLinks`
(never ``host.van``). :class:`MemberPort` is what a Node's parts use (its registration,
:mod:`hetps.cluster.enrol`, and its fault part, :mod:`hetps.faults.recovery`): the node
table and the hooks its host is told through. :class:`JobPort` is what the Scheduler's
parts use (registration, barriers, the launcher link and the fault parts
:mod:`hetps.faults.takeover` and :mod:`hetps.faults.elastic`): the job's table and the
scheduler's answers. A Node and a Scheduler are each one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from hetps.cluster.credentials import Credentials
from hetps.cluster.protocol import NodeInfo
from hetps.cluster.requests import RequestTracker
from hetps.config import NodeConfig
from hetps.transport.codec import Message
from hetps.transport.handshakes import RefusalLog

if TYPE_CHECKING:
    from hetps.metrics.live import LiveMetrics


class MemberPort(Protocol):
    """What a Node's parts use of it: who it is, the node table it holds and they change,
    its requests, and the hooks its host set."""

    cfg: NodeConfig
    role: str
    info: NodeInfo | None
    nodes: dict[int, NodeInfo]
    #: servers dead now, and where their keys went (a failover)
    down: set[int]
    redirect: dict[int, int]
    replicas: int
    elastic: int
    #: workers let go (HETPS_ELASTIC), and those started again that wait to join
    left: set[int]
    joining: set[int]
    recovery: bool
    metrics_interval: float
    metrics_job: str
    #: what it proves who it is with to a restarted scheduler, and how it is reached back
    cred: dict
    back_id: str | None
    barrier_passed: dict[str, int]
    last_ack: float
    requests: RequestTracker
    route_lock: threading.Lock
    done_workers: Callable[[], list[int]] | None
    on_failover: Callable[[int, int], None] | None
    on_rejoin: Callable[[int], None] | None
    on_worker_left: Callable[[int], None] | None

    #: this node's id
    @property
    def id(self) -> int: ...
    #: the role of a node of the table (None: no such node)
    def role_of(self, node_id: int) -> str | None: ...
    #: a node as a message names it
    def describe(self, node_id: int) -> str: ...
    #: start the receive thread
    def start_receiving(self) -> None: ...
    #: handle a message as if it came now
    def dispatch(self, msg: Message) -> None: ...
    #: this node cannot go on: fail every request, stop
    def fail(self, error: BaseException) -> None: ...
    #: stop the threads, close the sockets
    def close(self) -> None: ...


class RegistrationPart(Protocol):
    """A scheduler's registration (cluster/registration.py) as its fault parts use it."""

    def taken_back(self, nid: int) -> tuple[dict[str, Any], dict, dict]: ...


class Reached(Protocol):
    """A group's barrier as the fault parts use it: the highest barrier each node reached."""

    reached: dict[int, int]


class BarriersPart(Protocol):
    """A scheduler's barriers (cluster/barriers.py): each group's, read again when changed."""

    groups: dict[str, Reached]

    def changed(self) -> None: ...
    def release(self, group: str) -> None: ...


class TakeoverPart(Protocol):
    """A scheduler's takeover (hetps.faults.takeover): who may come back, taking them back."""

    def rejoin_slot(self, role: str, want: int) -> int | None: ...
    def readmit(self, msg: Message, nid: int, host: str, port: int, back: bytes) -> None: ...
    def take_back(
        self, msg: Message, nid: int, host: str, port: int, back: bytes, why: str
    ) -> NodeInfo | None: ...
    def redirects(self) -> dict[int, int]: ...


class WorkersPart(Protocol):
    """A scheduler's elastic workers (hetps.faults.elastic) as registration uses it."""

    def join_slot(self, role: str, want: int) -> int | None: ...
    def admit_worker(self, msg: Message, nid: int, host: str, port: int, back: bytes) -> None: ...


class LauncherPart(Protocol):
    """A scheduler's launcher link (cluster/launcher_link.py) as the takeover uses it."""

    def declare_silent(self, nid: int, reason: str) -> None: ...


class JobPort(Protocol):
    """What the Scheduler's parts use of it: the job's table, its other parts, and its
    ways of answering."""

    cfg: NodeConfig
    nodes: dict[int, NodeInfo]
    #: dead nodes and why; finished workers; workers let go (HETPS_ELASTIC) and how
    dead: dict[int, str]
    finished: dict[int, int]
    left: dict[int, str]
    #: servers admitted again after a death (how often), and who took over whom
    rejoined: dict[int, int]
    failovers: list[tuple[int, int]]
    last_seen: dict[int, float]
    replicas: int
    elastic: int
    recovering: bool
    ready: threading.Event
    exit_code: int | None
    failed_start: str | None
    services: dict[str, Callable[[JobPort, Message], None]]
    metrics: LiveMetrics | None
    to_launcher: Callable[[str], None] | None
    #: the other parts (each names what it offers)
    registration: RegistrationPart
    barriers: BarriersPart
    takeover: TakeoverPart
    workers_part: WorkersPart
    launcher: LauncherPart
    creds: Credentials
    refused_msgs: RefusalLog

    #: servers plus workers the job waits for
    @property
    def expected(self) -> int: ...
    #: send to a node (or a connection not yet named)
    def send_to(self, peer: int | str, msg: Message) -> None: ...
    #: answer a request
    def reply(
        self, request: Message, body: dict | None = None, arrays: list | None = None
    ) -> None: ...
    #: refuse a request, saying why
    def refuse_request(self, msg: Message, text: str) -> None: ...
    #: a node died
    def declare_dead(self, nid: int, reason: str) -> None: ...
    #: end the job if every worker finished
    def maybe_end(self) -> None: ...
    #: a node that came after a failed start was told why
    def refused_late(self) -> None: ...
    #: tell the services a worker finished
    def worker_finished_hooks(self) -> None: ...
    #: tell the services a worker came back
    def worker_back_hooks(self, info: NodeInfo) -> None: ...
