"""The composition root: it builds the scheduler, each server and each worker's store (their
Nodes too) with their parts (the fault wing :mod:`hetps.faults` among them) and meters, and
plugs the services in; it runs a process as the scheduler or a server until the job ends.
:func:`hetps.kv.create` makes a worker's store through :func:`new_worker_store`."""

from __future__ import annotations

import logging
import os
import sys
from functools import partial

from hetps.balance.agent import BalanceAgent
from hetps.balance.service import Planner
from hetps.cluster import batch
from hetps.cluster import protocol as P
from hetps.cluster.node import Node
from hetps.cluster.scheduler import Scheduler
from hetps.config import ConfigError, NodeConfig
from hetps.config.table import optimizer_names
from hetps.device import aggregator as ondevice
from hetps.device.aggregator import Device, DeviceRounds
from hetps.esync.service import EsyncService
from hetps.faults.elastic import ElasticWorkers
from hetps.faults.elastic_rounds import ElasticRounds
from hetps.faults.joining import Joining
from hetps.faults.recovery import Recovery
from hetps.faults.replicas import Replication
from hetps.faults.takeover import Takeover
from hetps.kvstore.aggregate import Aggregator
from hetps.kvstore.client import DistKVStore
from hetps.kvstore.pipeline import Pipeline
from hetps.kvstore.server import KVServer
from hetps.optim import kernels
from hetps.tables.server import machine_memory
from hetps.transport.codec import Message

log = logging.getLogger("hetps.roles")


def new_scheduler(cfg: NodeConfig, recover: bool = False, **kwargs) -> Scheduler:
    """A scheduler with its fault parts (a server's death, workers let go and in) and no
    service; ``kwargs`` go to :class:`~hetps.cluster.scheduler.Scheduler`."""
    return Scheduler(cfg, recover=recover, takeover=Takeover, elastic=ElasticWorkers, **kwargs)


def new_node(cfg: NodeConfig) -> Node:
    """A server's or a worker's Node with its fault part (failover, rejoin and readmit: a
    node's side of a death or a restart)."""
    return Node(cfg, recovery=Recovery)


def new_worker_store(name: str, cfg: NodeConfig) -> DistKVStore:
    """A worker's ``dist_*`` store (``hetps.kv.create`` on a worker): its Node (started: it
    registers), its pipeline, its fault part (joining), and, as ``cfg`` asks, the balance
    agent (HETPS_BALANCE) and the live metrics meter (the scheduler serves them)."""
    node = new_node(cfg).start()
    if node.replicas > 1 and not name.startswith("dist_sync"):
        text = (
            f"{name} with HETPS_REPLICAS={node.replicas}: copies keep dist_sync rounds only; "
            "use dist_sync, or HETPS_REPLICAS=1"
        )
        node.leave(text)
        node.close()
        raise ConfigError(text)
    balance = cfg.balance != "none"
    # network-aware mode paces pushes with a credit window (see Sender); the small requests
    # of a call go as one message per server (not with balancing: the BalanceAgent times
    # every message alone)
    pipeline = Pipeline(
        node,
        [s.id for s in node.servers()],
        cfg.push_window if balance else 0,
        0 if balance else min(cfg.batch_bytes, batch.ITEM_BYTES_MAX),
        cfg.request_timeout,
    )
    try:
        kv = DistKVStore(name, cfg, node=node, pipeline=pipeline, joining=Joining)
    except BaseException:
        pipeline.close()
        node.close()
        raise
    meter = None
    if node.metrics_interval > 0:  # latencies, rounds, link bytes (docs/LIVE.md)
        from hetps.metrics.reports import WorkerMeter

        meter = WorkerMeter(node.metrics_interval, kv.send_metrics, kv.link_bytes, own_output=True)
        meter.job = node.metrics_job
    kv.plug(agent=BalanceAgent(kv) if balance else None, meter=meter)
    return kv


class DeviceAggregator(DeviceRounds, Aggregator):
    """A server's round aggregator with the float keys on a device (HETPS_SERVER_DEVICE)."""


def new_server(node: Node, sync: bool | None = None, device: Device | None = None) -> KVServer:
    """A server's request handler on ``node`` with its fault parts (copies of its keys on
    other servers, rounds kept per worker); with ``device`` (HETPS_SERVER_DEVICE) it sums
    and updates there."""
    aggregator = Aggregator if device is None else partial(DeviceAggregator, device=device)
    return KVServer(
        node, sync, replication=Replication, elastic=ElasticRounds, aggregator=aggregator
    )


def make_scheduler(cfg: NodeConfig, recover: bool = False) -> Scheduler:
    """The scheduler with its services plugged in: ESync's state server, and the load
    planner when network-aware balancing is on (``HETPS_BALANCE``). ``recover``: it was
    started again at the address of one that died, and takes back the running job's nodes."""
    sched = new_scheduler(cfg, recover)
    esync = EsyncService(cfg.num_worker)
    esync.adopt = recover
    sched.register(
        P.ESYNC_REPORT,
        esync.as_scheduler_service(),
        on_worker_finished=esync.forget,
        on_worker_back=esync.count_again,
    )
    planner = None
    if cfg.balance != "none":
        planner = Planner.from_config(cfg)
        sched.register(
            P.BALANCE_REPORT,
            planner.handle,
            on_worker_finished=planner.release,
            quick=planner.take,
            gathers=planner.gathers,
        )
    if cfg.metrics_port is not None:  # live metrics (HETPS_METRICS_PORT, docs/LIVE.md)
        from hetps.metrics.live import LiveMetrics

        try:
            sched.metrics = LiveMetrics(sched, planner, esync).serve(
                cfg.metrics_port, cfg.metrics_host
            )
            sched.metrics.tail.install()  # the dashboard shows its last lines
        except BaseException:
            sched.close_unrun()
            raise
        sched.register(
            P.METRICS_REPORT, sched.metrics.handle, on_refused=sched.metrics.refused_body
        )
    return sched


def run_scheduler(cfg: NodeConfig) -> int:
    """Be the scheduler until the job ends; returns the exit code (0 = clean)."""
    sched = make_scheduler(cfg)
    if cfg.port_file:
        write_port_file(cfg.port_file, sched.port)
    return serve_scheduler(sched)


def serve_scheduler(sched: Scheduler) -> int:
    """Run a made scheduler until the job ends; the exit code (0 = clean). Where live metrics
    are served, it prints their addresses first (a launcher shows them) and at the end saves
    the dashboard's last state and lets a page and a last scrape read it (docs/LIVE.md)."""
    if sched.metrics is not None:
        print(f"hetps metrics {sched.metrics.url}", flush=True)
        print(f"hetps dashboard {sched.metrics.base_url}", flush=True)
    code = 1  # (an exception: the job failed)
    try:
        code = sched.run()
        return code
    finally:
        if sched.metrics is not None:
            from hetps.metrics.dashboard import finish_job

            finish_job(sched.metrics, code=code)
            sched.metrics.close()


def write_port_file(path: str, port: int) -> None:
    """Atomically write the bound port so a launcher can read it (no port probing)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def server_meter(node: Node, server: KVServer):
    """A server's live metrics reports (hetps.metrics.server_meter): rounds merged, optimizer
    seconds, replicas, and the bytes on its links to the workers."""
    from hetps.metrics.server_meter import ServerMeter

    def stats() -> tuple:
        snap = node.counters.snapshot()
        links = {
            w.rank: (snap[w.id].bytes_sent, snap[w.id].bytes_recv)
            for w in node.workers()
            if w.id in snap
        }
        return server.rounds, server.opt_s, node.replicas, links

    def send(body: dict) -> None:
        node.send(P.SCHEDULER_ID, Message(P.METRICS_REPORT, body=body))

    return ServerMeter(node.metrics_interval, send, stats)


def run_server(cfg: NodeConfig) -> int:
    """Be a KVStore server until the scheduler says the job is over; returns the exit code."""
    device = None
    if ondevice.parse(cfg.server_device) is not None:
        try:  # checked before anything connects: a server that cannot use it says so
            device = ondevice.open_device(cfg.server_device, cfg.local_rank)
        except (ImportError, RuntimeError, ValueError) as exc:
            print(f"hetps server: {exc}", file=sys.stderr, flush=True)
            return 2
        # (its first round says where it ran: hetps.device.aggregator.DeviceAggregator.tell)
    node = new_node(cfg)
    kernels.set_threads(cfg.server_threads)  # sums and optimizer steps of big keys
    server = new_server(node, device=device)
    # HETPS_TABLE_MAX_BYTES: the embedding tables' cap (0: half of this machine's memory)
    server.tables.cap = cfg.table_max_bytes or machine_memory() // 2
    server.tables.pull_bound = cfg.table_pull_bytes  # HETPS_TABLE_PULL_BYTES
    server.optimizers = optimizer_names(cfg.optimizers)  # what set_optimizer may send
    node.handler = server.handle
    node.lend(KVServer.BORROWS)  # pushes are merged straight out of the ring
    meter = None
    try:
        node.start()
        if cfg.verbose >= 1:
            log.info("server rank %d is up at %s", node.rank, node.endpoint)
        if node.metrics_interval > 0:  # the scheduler serves live metrics (docs/LIVE.md)
            meter = server_meter(node, server)
        node.exited.wait()
    finally:
        if meter is not None:
            meter.close()
        node.close()
    if node.failure is not None:
        log.error("server rank %d stops: %s", node.rank, node.failure)
        return 1
    return 0
