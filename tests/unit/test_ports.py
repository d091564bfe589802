"""Ports, not hosts (docs/ARCHITECTURE.md): every port a part takes names only what its real
host has, a real host built here passes ``isinstance`` against its ports, and no part takes
its host typed ``Any``."""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pytest

from hetps.app.worker import WorkerRun
from hetps.balance.agent import Layout, StoreLink
from hetps.cluster import ports as cp
from hetps.cluster.barriers import Barrier, Barriers
from hetps.cluster.hostlead import LeadNode
from hetps.cluster.launcher_link import LauncherLink
from hetps.cluster.node import Node
from hetps.cluster.ports import JobPort, MemberPort
from hetps.cluster.registration import Registration
from hetps.cluster.scheduler import Scheduler
from hetps.faults.elastic import ElasticWorkers
from hetps.faults.elastic_rounds import ElasticRounds
from hetps.faults.joining import Joining
from hetps.faults.rejoin import RunPort
from hetps.faults.replicas import Replication
from hetps.faults.takeover import Takeover
from hetps.kvstore.answers import Answers
from hetps.kvstore.client import DistKVStore
from hetps.kvstore.dense import DenseRequests
from hetps.kvstore.hostagg import HostAggregation, HostKey
from hetps.kvstore.hostagg_tables import AggHost, HostTables, Segment
from hetps.kvstore.keys import KeyMeta
from hetps.kvstore.local import LocalKVStore
from hetps.kvstore.pipeline import Pipeline
from hetps.kvstore.ports import Rejoin, ServerPort, StorePort
from hetps.kvstore.server import KVServer
from hetps.metrics.dashboard import Live
from hetps.metrics.live import LiveMetrics, SchedulerView
from hetps.metrics.prom import Snapshots
from hetps.metrics.roundlog import LoggedStore
from hetps.roles import new_server
from hetps.tables.server import Replies, Tables, TableServer
from hetps.tables.server_shard import CapHolder, Copies, Rounds, TablesPort
from hetps.tables.worker import DenseRounds, HostRows, SendQueue, TableStore, ThroughHost
from hetps.torch.collectives import SumStore
from hetps.transport.bulk import BulkVan
from hetps.transport.inbox import InboxVan
from hetps.transport.links import PeerLinks
from hetps.transport.van import Van

SRC = Path(__file__).resolve().parents[2] / "src" / "hetps"

#: each port and the real hosts that are handed to the parts that take it
PORTS = [
    (MemberPort, [Node]),
    (JobPort, [Scheduler]),
    (SchedulerView, [Scheduler]),
    (PeerLinks, [Van]),
    (StorePort, [DistKVStore]),
    (ServerPort, [KVServer]),
    (StoreLink, [DistKVStore]),
    (TableStore, [DistKVStore]),
    (TableServer, [KVServer]),
    (Replies, [Answers]),
    (CapHolder, [Tables]),
    (LoggedStore, [DistKVStore, LocalKVStore]),
    (SumStore, [DistKVStore, LocalKVStore]),
    (RunPort, [WorkerRun]),
    (AggHost, [HostAggregation]),
    (BulkVan, [Van]),
    (InboxVan, [Van]),
    (TablesPort, [Tables]),
    (LeadNode, [Node]),
    (Live, [LiveMetrics]),
    (Snapshots, [LiveMetrics]),
    # the ports of a host's parts, as a port names them
    (cp.RegistrationPart, [Registration]),
    (cp.BarriersPart, [Barriers]),
    (cp.Reached, [Barrier]),
    (cp.TakeoverPart, [Takeover]),
    (cp.WorkersPart, [ElasticWorkers]),
    (cp.LauncherPart, [LauncherLink]),
    (Rejoin, [Joining]),
    (DenseRounds, [DenseRequests]),
    (ThroughHost, [HostAggregation]),
    (HostRows, [HostTables]),
    (SendQueue, [Pipeline]),
    (Copies, [Replication]),
    (Rounds, [ElasticRounds]),
    (Segment, [HostKey]),
    (Layout, [KeyMeta]),
]

#: parameter and attribute names that hold a host (a store, node, scheduler, server, ...)
HOSTS = {"node", "sched", "host", "server", "owner", "kv", "store", "parent", "van", "agg"}


def port_names(port: type) -> set[str]:
    """What a port names: its annotated attributes, methods and properties."""
    names = set(port.__dict__.get("__annotations__", {}))
    names |= {n for n, v in port.__dict__.items() if callable(v) or isinstance(v, property)}
    return {n for n in names if not n.startswith("_")}


@cache
def host_names(cls: type) -> frozenset[str]:
    """What a host class has: its class's names and fields, and every ``self.x`` its methods
    set."""
    names = set(dir(cls))
    for klass in cls.__mro__[:-1]:
        names |= set(klass.__dict__.get("__annotations__", {}))
        tree = ast.parse(inspect.getsource(klass))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return frozenset(names)


@pytest.mark.parametrize(("port", "hosts"), PORTS, ids=[p.__name__ for p, _ in PORTS])
def test_a_port_names_only_what_its_hosts_have(port, hosts):
    for host in hosts:
        missing = sorted(port_names(port) - host_names(host))
        assert not missing, f"{port.__name__} names what {host.__name__} lacks: {missing}"


def test_real_hosts_pass_their_ports():
    """A server as roles builds it (on a node that only answers) is what its tables and fault
    parts take it as; its tables are what a shard takes as its owner; a local store is what a
    round log and the collectives take."""

    class _Node:
        def reply(self, msg, body=None, arrays=None, track=False):  # pragma: no cover
            pass

    srv = new_server(_Node())
    for port, obj in [
        (TableServer, srv),
        (ServerPort, srv),
        (Replies, srv.answers),
        (CapHolder, srv.tables),
        (TablesPort, srv.tables),
        (LoggedStore, LocalKVStore()),
        (SumStore, LocalKVStore()),
    ]:
        assert isinstance(obj, runtime_checkable(port)), f"{type(obj).__name__} vs {port}"


def test_no_part_takes_its_host_typed_any():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if "Any" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.arg):
                name, ann = node.arg, node.annotation
            elif isinstance(node, ast.AnnAssign):
                target = node.target
                name = (
                    target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                )
                ann = node.annotation
            else:
                continue
            if name.lstrip("_") in HOSTS and isinstance(ann, ast.Name) and ann.id == "Any":
                bad.append(f"{path.relative_to(SRC)}:{node.lineno} {name}: Any")
    assert not bad, "hosts typed Any (give the part a port):\n" + "\n".join(bad)


def any_members(port: type) -> list[str]:
    """The members of a port (its annotated attributes and properties) typed ``Any``, or
    holding ``Any`` (``dict[Any, Any]``): a port names each member's real type or port."""
    bad = []
    for node in ast.parse(textwrap.dedent(inspect.getsource(port))).body[0].body:
        if isinstance(node, ast.AnnAssign):
            name, ann = ast.unparse(node.target), node.annotation
        elif isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d) == "property" for d in node.decorator_list
        ):
            name, ann = node.name, node.returns
        else:
            continue
        if any(isinstance(n, ast.Name) and n.id == "Any" for n in ast.walk(ann)):
            bad.append(f"{port.__name__}.{name}: {ast.unparse(ann)}")
    return bad


def test_no_port_member_is_typed_any():
    bad = [m for port, _ in PORTS for m in any_members(port)]
    assert not bad, "port members typed Any (name the real class or a port):\n" + "\n".join(bad)


def test_the_any_member_check_sees_one():
    class _Port(Protocol):
        ok: dict[str, int]
        bad: dict[Any, int]

        @property
        def worse(self) -> Any: ...

    assert any_members(_Port) == ["_Port.bad: dict[Any, int]", "_Port.worse: Any"]


#: private names of other libraries' objects that their documented API has us read
FOREIGN = {"_getframe", "_exit", "_replace", "_indices", "_values", "_dynamo", "_BatchNorm"}


def private_reads(tree: ast.AST) -> list[ast.Attribute]:
    """Every ``obj._name`` in ``tree`` where ``obj`` is not ``self``, ``cls`` or ``super()``."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in FOREIGN
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and not (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super")
    ]


def private_imports(tree: ast.AST) -> list[ast.ImportFrom]:
    """Every ``from module import _name`` in ``tree`` (another module's private name)."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module != "__future__"
        and any(a.name.startswith("_") and not a.name.startswith("__") for a in node.names)
    ]


def test_no_module_reads_another_objects_private_names():
    """A part asks its port (or the object's public names); it never reads ``other._name``
    nor imports another module's ``_name``, and a port names no private member of its host."""
    bad = [
        f"{path.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}"
        for path in sorted(SRC.rglob("*.py"))
        for find in (private_reads, private_imports)
        for node in find(ast.parse(path.read_text()))
    ]
    for port, _ in PORTS:
        for node in ast.parse(inspect.getsource(port)).body[0].body:
            name = getattr(getattr(node, "target", None), "id", getattr(node, "name", ""))
            if name[:1] == "_" and name[:2] != "__":
                bad.append(f"{port.__name__} names {name}")
    assert not bad, "reads of another object's private names (give it a port):\n" + "\n".join(bad)


def test_the_private_read_check_sees_one():
    tree = ast.parse("def f(van, self):\n    self._ok = van._router\n    super()._fine()\n")
    assert [ast.unparse(n) for n in private_reads(tree)] == ["van._router"]


def test_the_private_import_check_sees_one():
    tree = ast.parse("from a import b, _c\nfrom d import __version__\nfrom e import _f as g\n")
    assert [ast.unparse(n) for n in private_imports(tree)] == [
        "from a import b, _c",
        "from e import _f as g",
    ]
