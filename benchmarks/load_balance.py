"""Network-aware load distribution on emulated heterogeneous links (issue 4, "Speed and results").

Every run is a real hetps cluster: ``N`` co-located nodes (server r and worker r on node r),
each in its own network namespace of ``hetps.netem`` shaped by ``tc`` (docs/NETEM.md), a
scheduler hosting the load planner, and a worker script (this file, ``--worker``) that pushes
and pulls the parameter shapes of a real model every iteration. For every scenario, model and
scheme it reports:

- **ASRIT**: mean single-round iteration time of worker 0 (``hetps summary``'s definition);
- **speed**: samples/min with ``--batch-size`` samples per worker and iteration;
- **comm**: the iteration's communication time (push of every key, pull of every key), the
  slowest worker's, median over the measured iterations;
- **lower bound**: ``hetps.balance.lower_bound`` on the TRUE tc rates, as TCP goodput
  (``hetps.netem.goodput_mbit``), for the model's bytes (docs/BALANCE.md §8); in a dynamic
  network, for the rates in force at each iteration's midpoint;
- **ratio_to_bound**: median over iterations of comm / lower bound.

Scenarios: ``static`` (node rates drawn uniformly in [--lo, --hi] Mbit/s with --seed),
``dynamic`` (the same, re-drawn every --period seconds, counted from the first measured
iteration), ``homogeneous`` (every node at --homo Mbit/s: the cost of probing and re-planning).
Schemes: average, elastic, aware, optimal (HETPS_BALANCE), plus ``mxnet-hash`` (balancing off,
MXNet's placement) on the static scenario and ``average-fixed`` (average, planned once:
HETPS_REPLAN_EVERY huge) on the homogeneous one.

The nodes' TCP congestion control is Reno (``--tcp-cc``; ``host`` keeps the host's default,
BBR on this project's machines, which leaves a parameter server's bursty flows slow with empty
queues: docs/NETEM.md §4). The raw-TCP baseline runs in the same namespaces, so with the same
congestion control.

Compute is omitted (communication only) unless --compute-s adds a fixed sleep per iteration.
The models are scaled down (every key's element count divided by one factor per model, so the
static scenario's lower bound is --target-s seconds); the number, order and relative sizes of
the keys are the real ones (``hetps.app.models.param_shapes``).

Each run logs in the hetps metrics format under --logdir (run.json with scheme, slice_size,
scenario; worker-<r>.jsonl with srit_s, comm_s, overhead_s), and ``hetps plot`` draws the
figures into --figures. Run as root (network namespaces and tc).

    .venv/bin/python benchmarks/load_balance.py --quick                 # < 5 min
    .venv/bin/python benchmarks/load_balance.py --json runs/load_balance.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODELS = ("mobilenet-v1", "resnet50-v1", "alexnet")
SCHEMES = ("average", "elastic", "aware", "optimal")
ELEM_BYTES = 4  # float32
#: slice size (elements). Every model is scaled to the same bytes per iteration, so one size
#: serves all. A sweep of the oracle plan over 2,048..65,536 (MobileNet-v1, static
#: 8 nodes) and fitted T(q) = c + a*q + b*ceil(P/q) (slicing.fit_granularity): per-slice
#: overhead h = b*S = 1.5 ms, best q = 6.1K elements; 8,192 is the power of two nearest it
#: (65,536 was 12% slower on the oracle plan). With Reno:
#: 2,048 1.48, 4,096 1.35, 8,192 1.26, 16,384 1.26 (oracle plan, ratio to the bound).
SLICE_ELEMS = 1 << 13
TCP_CACHE: dict[tuple[str, str], list[float]] = {}  # (scenario, model) -> raw-TCP seconds
TCP_PACED_CACHE: dict[tuple[str, str], list[float]] = {}  # the same, flows paced (--tcp-pace)
SO_MAX_PACING_RATE = 47  # Linux socket option (asm-generic/socket.h)


# ============================================================================================
# Worker (runs inside a node's namespace; keep imports light: no torch)


def worker_main() -> int:
    import numpy as np

    import hetps.kv
    from hetps.metrics import IterationLog

    run_dir = Path(os.environ["LB_RUN_DIR"])
    cfg = json.loads((run_dir / "bench.json").read_text())
    sizes = [int(n) for n in cfg["sizes"]]
    iters, warmup = int(cfg["iters"]), int(cfg["warmup"])
    batch, compute_s = int(cfg["batch_size"]), float(cfg["compute_s"])

    kv = hetps.kv.create("dist_sync")
    rank, nw = kv.rank, kv.num_workers
    keys = list(range(len(sizes)))
    kv.init(keys, [np.zeros(n, np.float32) for n in sizes])
    grads = [np.ones(n, np.float32) for n in sizes]
    bufs = [np.empty(n, np.float32) for n in sizes]
    total_elems = sum(sizes)
    log = None
    # diagnostics: the raw link samples this worker reports (private attribute, read only)
    dump = open(run_dir / f"samples-{rank}.jsonl", "w") if cfg.get("dump_samples") else None
    warm: list[dict] = []
    wrong = 0
    try:
        for it in range(warmup + iters):
            if it == warmup:
                # the measured phase starts now, for every worker: run.json's started_at
                kv.barrier()
                if rank == 0:
                    meta_path = run_dir / "run.json"
                    meta = json.loads(meta_path.read_text())
                    meta["started_at"] = time.time()
                    tmp = meta_path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(meta))
                    os.replace(tmp, meta_path)
                    (run_dir / "measure_start").write_text(str(meta["started_at"]))
                kv.barrier()
                log = IterationLog(run_dir, rank)
            if dump is not None:
                dump.write(
                    json.dumps({"iter": it - warmup, "samples": list(kv.agent.samples)}) + "\n"
                )
            t0 = time.time()
            plan = kv.rebalance()  # report link measurements, switch to this round's plan
            t1 = time.time()
            if compute_s > 0:
                time.sleep(compute_s)
            t2 = time.time()
            handles = []
            if cfg.get("pushpull"):  # one request per key: the answer carries the sum
                for k in keys:
                    handles.append(kv.pushpull(k, grads[k], out=bufs[k], block=False))
                for h in handles:
                    h.wait()
                t_push = time.time()
            else:
                # diagnostics (--stamps): when each request was handed to the network and
                # when each slice's push and pull were answered
                stamps = [] if cfg.get("stamps") else None
                if stamps is not None and not hasattr(kv._sender, "_lb_orig"):
                    orig = kv._sender.submit
                    kv._sender._lb_orig = orig

                    def submit(key, priority, send, cost=0, _o=orig):
                        def stamped():
                            kv._sender._lb_stamps.append(("send", str(key), cost, time.time()))
                            return send()

                        return _o(key, priority, stamped, cost)

                    kv._sender.submit = submit
                if stamps is not None:
                    kv._sender._lb_stamps = stamps
                for k in keys:  # as a framework does: push a gradient, pull its weights
                    handles.append(kv.push(k, grads[k], block=False))
                    handles.append(kv.pull(k, out=bufs[k], block=False))
                    if stamps is not None:
                        for kind, h in (("push", handles[-2]), ("pull", handles[-1])):
                            for j, f in enumerate(h.futures):

                                def cb(v, _o=f._callback, kind=kind, k=k, j=j, st=stamps):
                                    st.append((kind, k, j, time.time()))
                                    if _o is not None:
                                        _o(v)

                                f._callback = cb
                for h in handles[0::2]:
                    h.wait()
                t_push = time.time()
                for h in handles[1::2]:
                    h.wait()
            t3 = time.time()
            if not cfg.get("pushpull") and stamps is not None and it >= warmup:
                with open(run_dir / f"stamps-{rank}.jsonl", "a") as sf:
                    parts = {k: [p.server for p in kv.meta[k].parts] for k in keys}
                    sf.write(
                        json.dumps(
                            {"iter": it - warmup, "t2": t2, "stamps": stamps, "parts": parts}
                        )
                        + "\n"
                    )
            # no optimizer: the round's sum replaces the value, so every element is nw
            ok = all(bool((b == nw).all()) for b in bufs)
            wrong += not ok
            remote = sum(
                p.stop - p.start for k in keys for p in kv.meta[k].parts if p.server != rank
            )
            rec = {
                "rank": rank,
                "iter": it - warmup,
                "epoch": 0,
                "samples": batch,
                "loss": None,
                "local_steps": 1,
                "compute_s": t2 - t1,
                "push_s": t_push - t2,
                "pull_s": t3 - t_push,
                "wait_s": 0.0,
                "bytes_sent": remote * ELEM_BYTES,
                "bytes_recv": remote * ELEM_BYTES,
                "srit_s": t3 - t0,
                "comm_s": t3 - t2,
                "overhead_s": t1 - t0,
                "value_ok": ok,
                "t_start_unix": t0,
                "t_comm_unix": t2,
                "t_end_unix": t3,
                "own_share": 1.0 - remote / total_elems,
            }
            if plan is not None:
                rec["plan_epoch"] = plan["epoch"]
                rec["plan_s"] = plan.get("plan_s")
                if rank == 0:
                    rec["plan"] = plan["shares"]
                    rec["link_matrix"] = plan["link_matrix"]
                    rec["node_rates"] = plan.get("node_rates")
                    rec["plans_kept"] = plan.get("kept")
                    rec["spread"] = plan.get("spread")  # the spread asked for next
                    # a round that surprised the planner (measured against predicted time,
                    # over the recent median) and the re-calibrations asked for so far
                    rec["surprise"] = plan.get("surprise")
                    rec["recalibrations"] = plan.get("recalibrations")
            if log is None:
                warm.append(rec)
            else:
                rec["t"] = log.now()
                log.write(rec)
        if rank == 0:
            (run_dir / "warmup.json").write_text(json.dumps(warm))
        kv.barrier()
    finally:
        if log is not None:
            log.close()
        kv.close()
    if wrong:
        print(f"worker {rank}: {wrong} iteration(s) pulled a wrong value", flush=True)
        return 3
    return 0


def oracle_scheduler_main() -> int:
    """The stock scheduler, except that its planner is given the TRUE node rates (tc goodput
    of the static scenario) instead of its own link measurements: a diagnostic that separates
    what the plan costs from what the measurement costs. Not hetps' behaviour."""
    from hetps import cli
    from hetps.balance import Network
    from hetps.cluster import planner as planner_mod
    from hetps.netem import load_scenario

    n = int(os.environ["DMLC_NUM_WORKER"])
    sc = load_scenario(os.environ["HETPS_NETEM_SCENARIO"], nodes=n)
    c = goodput_bytes(sc.rates_at(0))

    class TrueRates:
        @staticmethod
        def from_matrix(bw, **_kw):
            return Network.from_rates(c, c)

    planner_mod.Network = TrueRates  # planner.plan() builds its network through this name
    planner_mod.Planner.node_network = lambda self: Network.from_rates(c, c)
    return cli.main(["scheduler"])


ROBUST_MIN_BYTES = 64 * 1024  # samples below this measure dispatch time, not the link
ROBUST_KEEP = 1.05  # keep the current slice assignment unless the new one is >5% faster


def robust_scheduler_main() -> int:
    """The stock scheduler with two changes to its planner, as an A/B of a proposed fix
    (NOT hetps' behaviour; see docs/BALANCE.md §10):

    1. link estimates: samples under 64 KiB are dropped, and each link gets one sample per
       round, the median of that round's samples (then the stock EWMA across rounds);
    2. hysteresis: the planner keeps the current slice assignment unless the new one is
       predicted (on the same estimate) to be more than 5% faster.
    """
    import numpy as np

    from hetps import cli
    from hetps.balance import EstimateTable, Network, iteration_time
    from hetps.balance import assign as stock_assign
    from hetps.cluster import planner as planner_mod

    class RoundMedianTable(EstimateTable):
        def __init__(self, n: int, alpha: float = 0.3) -> None:
            super().__init__(n, alpha=alpha)
            self._round: dict[tuple[int, int], list[tuple[float, float, float]]] = {}

        def observe(self, src, dst, size_bytes, t_start, t_end):  # type: ignore[override]
            if size_bytes < ROBUST_MIN_BYTES or src == dst or not t_end > t_start:
                return False
            self._round.setdefault((src, dst), []).append((size_bytes, t_start, t_end))
            return True

        def matrix(self):  # type: ignore[override]
            for (i, j), xs in self._round.items():
                rates = [b / (t1 - t0) for b, t0, t1 in xs]
                med = float(np.median(rates))
                super().observe(i, j, med, 0.0, 1.0)  # one sample of rate `med`
            self._round = {}
            return super().matrix()

    last_net: dict[str, object] = {}

    class CapturingNetwork:
        @staticmethod
        def from_matrix(bw, **kw):
            net = Network.from_matrix(bw, **kw)
            last_net["net"] = net
            return net

    def sticky_assign(slices, shares, previous=None, probe_num=0):
        new = stock_assign(slices, shares, previous=previous, probe_num=probe_num)
        net = last_net.pop("net", None)
        if previous is None or net is None:
            return new
        lengths = np.array([s.length for s in slices], dtype=float)
        n = len(shares)

        def t(a):
            return iteration_time(net, np.bincount(np.asarray(a), weights=lengths, minlength=n))

        try:
            if t(previous) <= ROBUST_KEEP * t(new):
                return np.asarray(previous, dtype=np.int64)
        except Exception:  # noqa: BLE001 - fall back to the stock behaviour
            pass
        return new

    planner_mod.EstimateTable = RoundMedianTable
    planner_mod.Network = CapturingNetwork
    planner_mod.assign = sticky_assign
    return cli.main(["scheduler"])


def tcp_peer_main(bind_ip: str) -> int:
    """One node of the raw-TCP baseline (runs in the node's namespace): listen, print the
    port; read ``{"send": [[ip, port, nbytes], ...], "recv": k}``; on "go" send every flow
    and receive ``k`` flows at once, all plain blocking sockets in threads; print
    ``{"t0", "end"}`` (wall clock; every namespace shares the host's clock)."""
    import socket

    srv = socket.socket()
    srv.bind((bind_ip, 0))
    srv.listen(64)
    print(srv.getsockname()[1], flush=True)
    job = json.loads(sys.stdin.readline())
    ends: list[float] = []
    lock = threading.Lock()

    def receive(conn) -> None:
        with conn:
            while conn.recv(1 << 20):
                pass
        with lock:
            ends.append(time.time())

    def accept_all() -> None:
        threads = []
        for _ in range(job["recv"]):
            conn, _ = srv.accept()
            t = threading.Thread(target=receive, args=(conn,))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()

    def send(ip: str, port: int, nbytes: int, pace: float = 0.0) -> None:
        with socket.create_connection((ip, port)) as c:
            if pace > 0:  # the kernel paces this flow (TCP's own pacing; any qdisc)
                c.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(pace))
            c.sendall(memoryview(bytearray(nbytes)))
            c.shutdown(socket.SHUT_WR)
            c.recv(1)

    acc = threading.Thread(target=accept_all)
    acc.start()
    sys.stdin.readline()  # go
    t0 = time.time()
    senders = [threading.Thread(target=send, args=tuple(f)) for f in job["send"]]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    acc.join()
    print(json.dumps({"t0": t0, "end": max(ends) if ends else t0}), flush=True)
    return 0


def plan_link_bytes(rates_mbit: list[float], total_bytes: float):
    """Bytes on every link i -> j in one iteration of the OPTIMAL plan for the true rates
    (co-located: worker i pushes x_j to server j, server i sends x_i back to worker j)."""
    import numpy as np

    from hetps.balance import Network, make_plan

    c = goodput_bytes(rates_mbit)
    n = len(c)
    x = np.asarray(
        make_plan(
            "optimal",
            float(total_bytes),
            network=Network.from_rates(c, c),
            servers=list(range(n)),
            workers=list(range(n)),
        ),
        dtype=float,
    )
    return [[0 if i == j else int(x[i] + x[j]) for j in range(n)] for i in range(n)]


def tcp_baseline(net, link_bytes, repeats: int = 3, pace_s: float = 0.0) -> list[float]:
    """Seconds raw TCP takes to move ``link_bytes[i][j]`` on every link at once, in the
    run's own namespaces: what the emulated network allows with no parameter server at all
    (no push-before-pull dependency, no framing, one stream per link). With ``pace_s`` > 0
    every flow is paced by the kernel (SO_MAX_PACING_RATE) to finish in ``pace_s`` seconds:
    a perfect schedule's rates, which no FIFO and no congestion control will find alone."""
    import subprocess

    n = len(link_bytes)
    out = []
    for _ in range(repeats):
        procs = [
            net.popen(
                i,
                [sys.executable, __file__, "--tcp-peer", net.node_ip(i)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]
        try:
            ports = [int(p.stdout.readline()) for p in procs]
            for i, p in enumerate(procs):
                send = [
                    [net.node_ip(j), ports[j], link_bytes[i][j]]
                    + ([link_bytes[i][j] / pace_s] if pace_s > 0 else [])
                    for j in range(n)
                    if j != i and link_bytes[i][j] > 0
                ]
                recv = sum(1 for k in range(n) if k != i and link_bytes[k][i] > 0)
                p.stdin.write(json.dumps({"send": send, "recv": recv}) + "\n")
                p.stdin.flush()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            res = [json.loads(p.stdout.readline()) for p in procs]
            out.append(max(r["end"] for r in res) - min(r["t0"] for r in res))
        finally:
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
    return out


# ============================================================================================
# Harness


def model_sizes(name: str, cache: Path) -> list[int]:
    """Element count of every parameter of ``name`` (registration order)."""
    data = json.loads(cache.read_text()) if cache.exists() else {}
    if name not in data:
        import numpy as np

        from hetps.app.models import param_shapes

        data[name] = [int(np.prod(s)) for s in param_shapes(name)]
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(data))
    return data[name]


def scale_sizes(sizes: list[int], factor: float) -> list[int]:
    """Every key divided by ``factor`` (at least one element each)."""
    return [max(1, round(n / factor)) for n in sizes]


def pack_sizes(sizes: list[int], bucket: int) -> list[int]:
    """Fuse consecutive keys smaller than ``bucket`` elements into buckets of at least
    ``bucket`` elements (as a framework's gradient buckets); larger keys stay whole."""
    if bucket <= 0:
        return list(sizes)
    out: list[int] = []
    acc = 0
    for n in sizes:
        if n >= bucket:
            if acc:
                out.append(acc)
                acc = 0
            out.append(n)
            continue
        acc += n
        if acc >= bucket:
            out.append(acc)
            acc = 0
    if acc:
        out.append(acc)
    return out


def scenario_dict(kind: str, opts: argparse.Namespace) -> dict:
    d = _scenario_dict(kind, opts)
    if opts.tcp_cc != "host":
        d["tcp_cc"] = opts.tcp_cc
    return d


def _scenario_dict(kind: str, opts: argparse.Namespace) -> dict:
    n = opts.nodes
    if kind == "static":
        return {
            "kind": "static",
            "nodes": n,
            "lo_mbit": opts.lo,
            "hi_mbit": opts.hi,
            "seed": opts.seed,
        }
    if kind == "dynamic":
        return {
            "kind": "dynamic",
            "nodes": n,
            "lo_mbit": opts.lo,
            "hi_mbit": opts.hi,
            "seed": opts.seed,
            "period_s": opts.period,
        }
    if kind == "homogeneous":
        return {"kind": "static", "nodes": n, "rates_mbit": [opts.homo] * n}
    raise ValueError(kind)


def toml_text(d: dict) -> str:
    lines = ["[network]"]
    for k, v in d.items():
        if isinstance(v, str):
            lines.append(f'{k} = "{v}"')
        elif isinstance(v, list):
            lines.append(f"{k} = [{', '.join(f'{x:g}' for x in v)}]")
        else:
            lines.append(f"{k} = {v}")
    return "\n".join(lines) + "\n"


def tcp_cc_of(sc) -> str:
    """The TCP congestion control the run's nodes use (the scenario's, else the host's)."""
    if sc.tcp_cc:
        return sc.tcp_cc
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def goodput_bytes(rates_mbit: list[float]) -> list[float]:
    from hetps.netem import goodput_mbit

    return [goodput_mbit(r) * 1e6 / 8 for r in rates_mbit]


def bound(rates_mbit: list[float], total_bytes: float) -> float:
    from hetps.balance import lower_bound

    c = goodput_bytes(rates_mbit)
    return float(lower_bound(c, c, total_bytes))


def rates_at(changes: list[tuple[float, int, list[float]]], t: float) -> list[float]:
    cur = changes[0][2]
    for tc, _, r in changes:
        if tc <= t:
            cur = r
    return cur


def tc_batch(ns: str, cmds: list[str]) -> None:
    """Run ``tc`` commands in namespace ``ns`` as one batch (fails on the first error)."""
    import subprocess

    subprocess.run(
        ["tc", "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n", text=True, check=True
    )


def fifo_limit(rate_mbit: float) -> int:
    """Bytes of a FIFO holding 0.5 s at ``rate_mbit`` (100 frames to 16 MiB), as hetps.netem's."""
    rate_bit = max(8000, int(round(rate_mbit * 1e6)))
    return int(min(max(rate_bit / 8 * 0.5, 100 * 1514), 16 << 20))


def tcp_counters(net) -> list[dict]:
    """Per node: its namespace's TCP segments sent, retransmitted, and retransmission
    timeouts (all, and those found spurious) since its namespace was made: the run, and the
    raw-TCP baseline when it ran in the same namespaces (``nstat``), for tcp_counters.json."""
    import subprocess

    names = ("TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPSpuriousRTOs", "TcpOutSegs")
    out = []
    for i in range(net.n):
        row: dict = {}
        out.append(row)
        try:  # nstat comes with iproute2, like ip and tc; a diagnostic never fails a run
            res = subprocess.run(  # -s: leave nstat's history file (shared by all) alone
                net.exec_argv(i, ["nstat", "-asz", *names]),
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in names:
                row[parts[0]] = int(parts[1])
    return out


def ns_tweaks(net, tweaks: list[str]) -> None:
    """Diagnostics only (not hetps' emulator): change TCP/queueing inside the run's own
    namespaces. ``noidle``: no slow-start restart after idle; ``shortq``: 50 ms TBF queues;
    ``ackprio``: under every TBF, small packets (< 128 bytes: acks, forecasts, receipts)
    leave before queued data; ``fairq``: round robin between peers (one FIFO per peer)
    under every TBF instead of one FIFO."""
    import ipaddress
    import subprocess

    for i in range(net.n):
        if "ackprio" in tweaks:
            limit = fifo_limit(net.rates[i])
            cls = "rate 100gbit ceil 100gbit burst 1m cburst 1m quantum 60000"
            for ns, dev in ((net.node_ns(i), "eth0"), (net.hub, f"v{i}")):
                cmds = [
                    f"qdisc add dev {dev} parent 1:1 handle 2: htb default 20",
                    f"class add dev {dev} parent 2: classid 2:10 htb {cls} prio 0",
                    f"class add dev {dev} parent 2: classid 2:20 htb {cls} prio 1",
                    f"qdisc add dev {dev} parent 2:20 handle 20: bfifo limit {limit}",
                    f"filter add dev {dev} parent 2: protocol ip prio 1 u32 "
                    "match u16 0x0000 0xff80 at 2 flowid 2:10",
                ]
                tc_batch(ns, cmds)
        if "fairq" in tweaks:
            # this kernel has no sfq/fq_codel/drr: an HTB under the TBF with one equal class
            # per peer (DRR among the classes, 0.5 s FIFO each) shares the link round robin
            # between destinations at a node's egress and between sources at its ingress
            limit = fifo_limit(net.rates[i])
            cls = "rate 100gbit ceil 100gbit burst 64k cburst 64k quantum 1514"
            for ns, dev, field in ((net.node_ns(i), "eth0", 16), (net.hub, f"v{i}", 12)):
                cmds = [
                    f"qdisc add dev {dev} parent 1:1 handle 2: htb default 99",
                    f"class add dev {dev} parent 2: classid 2:99 htb {cls} prio 0",
                    f"qdisc add dev {dev} parent 2:99 handle 99: bfifo limit {limit}",
                ]
                for j in range(net.n):
                    if j == i:
                        continue
                    c = 10 + j
                    cmds += [
                        f"class add dev {dev} parent 2: classid 2:{c} htb {cls} prio 0",
                        f"qdisc add dev {dev} parent 2:{c} handle {c}: bfifo limit {limit}",
                        f"filter add dev {dev} parent 2: protocol ip prio 1 u32 "
                        f"match u32 0x{int(ipaddress.IPv4Address(net.node_ip(j))):08x} 0xffffffff "
                        f"at {field} flowid 2:{c}",
                    ]
                tc_batch(ns, cmds)
        if "noidle" in tweaks:
            subprocess.run(
                net.exec_argv(i, ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"]),
                check=True,
            )
        if "shortq" in tweaks:  # TBF queue of 50 ms instead of 0.5 s
            rate_bit = max(8000, int(round(net.rates[i] * 1e6)))
            burst = max(2 * 1514, int(rate_bit / 8 * 0.001))
            limit = max(int(rate_bit / 8 * 0.05), 20 * 1514)
            p = ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]
            subprocess.run(
                [
                    "tc",
                    "-n",
                    net.node_ns(i),
                    "qdisc",
                    "change",
                    "dev",
                    "eth0",
                    "root",
                    "handle",
                    "1:",
                ]
                + p,
                check=True,
            )
            subprocess.run(
                ["tc", "-n", net.hub, "qdisc", "change", "dev", f"v{i}", "root", "handle", "1:"]
                + p,
                check=True,
            )


def tc_drops(net) -> dict[str, list[int]]:
    """Packets each node's egress and ingress TBF dropped during the run (tail drops)."""
    import re
    import subprocess

    out: dict[str, list[int]] = {"egress": [], "ingress": []}
    for i in range(net.n):
        for name, ns, dev in (("egress", net.node_ns(i), "eth0"), ("ingress", net.hub, f"v{i}")):
            text = subprocess.run(
                ["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True
            ).stdout
            m = re.search(r"dropped (\d+)", text)
            out[name].append(int(m.group(1)) if m else -1)
    return out


def tc_monitor(net, node: int, run_dir: Path, done: threading.Event) -> None:
    """Diagnostics: bytes through node ``node``'s egress and ingress TBFs every 0.1 s; with
    ``node`` -1, every node's bytes sent and received (the hub's veth counters, one ``ip``
    call) and the queue (backlog) of every node's uplink and downlink TBF, about every
    0.1 s (link_monitor.jsonl)."""
    import re
    import subprocess

    if node < 0:
        with open(run_dir / "link_monitor.jsonl", "w") as f:
            while not done.wait(0.05):
                out = subprocess.run(
                    ["ip", "-n", net.hub, "-s", "-j", "link", "show"],
                    capture_output=True,
                    text=True,
                ).stdout
                row: dict = {"t": time.time(), "sent": {}, "recv": {}}
                for dev in json.loads(out or "[]"):
                    name = dev.get("ifname", "")
                    if name.startswith("v") and name[1:].isdigit():
                        st = dev["stats64"]
                        row["sent"][name[1:]] = st["rx"]["bytes"]  # the node's uplink
                        row["recv"][name[1:]] = st["tx"]["bytes"]  # its downlink
                out = subprocess.run(
                    ["tc", "-s", "-j", "-n", net.hub, "qdisc", "show"],
                    capture_output=True,
                    text=True,
                ).stdout
                row["backlog"] = {
                    q["dev"][1:]: q.get("backlog", 0)
                    for q in json.loads(out or "[]")
                    if q.get("kind") == "tbf" and q.get("dev", "").startswith("v")
                }
                row["up_backlog"] = {}  # the uplinks' queues: one tc call per node
                for i in range(net.n):
                    out = subprocess.run(
                        ["tc", "-s", "-j", "-n", net.node_ns(i), "qdisc", "show", "dev", "eth0"],
                        capture_output=True,
                        text=True,
                    ).stdout
                    qs = [q for q in json.loads(out or "[]") if q.get("kind") == "tbf"]
                    row["up_backlog"][str(i)] = qs[0].get("backlog", 0) if qs else None
                f.write(json.dumps(row) + "\n")
        return
    pat = re.compile(r"Sent (\d+) bytes .*?backlog (\d+)b", re.S)
    with open(run_dir / "tc_monitor.jsonl", "w") as f:
        while not done.wait(0.1):
            row = {"t": time.time()}
            for name, argv in (
                ("egress", ["tc", "-s", "-n", net.node_ns(node), "qdisc", "show", "dev", "eth0"]),
                ("ingress", ["tc", "-s", "-n", net.hub, "qdisc", "show", "dev", f"v{node}"]),
            ):
                out = subprocess.run(argv, capture_output=True, text=True).stdout
                m = pat.search(out)
                if m:
                    row[name] = int(m.group(1))
                    row[name + "_backlog"] = int(m.group(2))
            f.write(json.dumps(row) + "\n")


def estimate_quality(run, changes: list, n: int) -> dict:
    """How well the planner knew the network: its link matrix (worker 0's records) turned into
    node rates the way the planner does (``Network.from_matrix``, "sum": a node's rate = the sum
    of its links), against the true tc goodput; and how often the plan changed."""
    import numpy as np

    recs = [r for r in run.records.get(0, []) if r.get("link_matrix")]
    out: dict = {
        "estimate_rel_err_median": None,
        "estimate_rel_err_max": None,
        "plan_changes": None,
    }
    if not recs:
        return out
    errs = []
    for r in recs:
        true = np.array(goodput_bytes(rates_at(changes, r["t_start_unix"])))
        nr = r.get("node_rates")
        if nr and any(v is not None for v in nr["up"] + nr["down"]):
            # the planner's own per-node estimates (what its plans use)
            ests = [np.array([np.nan if v is None else v for v in nr[k]]) for k in ("up", "down")]
        else:
            m = np.array([[np.nan if v is None else v for v in row] for row in r["link_matrix"]])
            np.fill_diagonal(m, 0.0)
            ests = [m.sum(axis=1), m.sum(axis=0)]
        for est in ests:
            errs += [e for e in np.abs(est / true - 1.0) if np.isfinite(e)]
    if not errs:
        return out
    epochs = [r["plan_epoch"] for r in run.records[0] if "plan_epoch" in r]
    out["estimate_rel_err_median"] = float(np.median(errs))
    out["estimate_rel_err_max"] = float(np.max(errs))
    out["plan_changes"] = int(epochs[-1] - epochs[0]) if epochs else None
    return out


def run_one(
    opts: argparse.Namespace,
    run_dir: Path,
    scen_name: str,
    scen: dict,
    model: str,
    scheme: str,
    sizes: list[int],
    scale: float,
    slice_elems: int,
) -> dict:
    """One cluster run; returns the result row (and the raw per-iteration figures)."""
    import numpy as np
    from _common import PINNED_THREADS, median

    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import Launcher
    from hetps.launch.wrappers import netem_wrapper
    from hetps.metrics import RunWriter, load_run, run_meta
    from hetps.metrics.summary import summarize_run
    from hetps.netem import Netem, load_scenario

    if run_dir.exists():
        shutil.rmtree(run_dir)
    n = opts.nodes
    total_bytes = float(sum(sizes) * ELEM_BYTES)
    sc = load_scenario(scen, nodes=n)
    RunWriter(
        run_dir,
        run_meta(
            "sync",
            model,
            n,
            n,
            opts.batch_size,
            scheme=scheme,
            slice_size=slice_elems,
            scenario=scen_name,
            scale_factor=round(scale, 3),
            model_bytes=int(total_bytes),
            rates_mbit=[round(r, 2) for r in sc.rates_at(0)],
            tcp_cc=tcp_cc_of(sc),
            period_s=scen.get("period_s"),
            compute_s=opts.compute_s,
            ns_tweak=opts.ns_tweak,
            argv=sys.argv[1:],
        ),
    )
    (run_dir / "scenario.toml").write_text(toml_text(scen))
    (run_dir / "bench.json").write_text(
        json.dumps(
            {
                "sizes": sizes,
                "iters": opts.iters,
                "warmup": opts.warmup,
                "batch_size": opts.batch_size,
                "compute_s": opts.compute_s,
                "pushpull": opts.pushpull,
                "dump_samples": opts.dump_samples,
                "stamps": opts.stamps,
            }
        )
    )
    env = {
        **PINNED_THREADS,
        "LB_RUN_DIR": str(run_dir),
        "PS_HEARTBEAT_TIMEOUT": "120",
        "HETPS_REQUEST_TIMEOUT": "600",
        "HETPS_COLOCATE": "1",
        "HETPS_NETEM_SCENARIO": str(run_dir / "scenario.toml"),
    }
    if scheme != "mxnet-hash":
        env["HETPS_BALANCE"] = "average" if scheme == "average-fixed" else scheme
        env["HETPS_SLICE_ELEMS"] = str(slice_elems)
    else:  # MXNet splits keys above 10^6 elements: the same keys are split in the scaled model
        env["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(max(1, round(1_000_000 / scale)))
    if opts.src:
        env["PYTHONPATH"] = os.pathsep.join(
            [opts.src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
    if scheme == "average-fixed":
        env["HETPS_REPLAN_EVERY"] = str(10**9)  # plans once (round 1), then never reports
    me = str(Path(__file__).resolve())
    spec = LaunchSpec(
        num_workers=n,
        num_servers=n,
        command=[sys.executable, me, "--worker"],
        env=env,
        start_timeout=120,
    )
    for variant in ("oracle", "robust"):
        if scheme.endswith("-" + variant):
            env["HETPS_BALANCE"] = scheme.removesuffix("-" + variant)
            spec.scheduler_command = [sys.executable, me, f"--{variant}-scheduler"]
    changes: list[tuple[float, int, list[float]]] = []
    t_begin = time.time()
    with open(run_dir / "launch.log", "w") as logf, Netem(sc) as net:
        spec.host = net.node_ip(0)
        spec.wrap = netem_wrapper(net, n, True)
        changes.append((time.time(), 0, list(net.rates)))
        ns_tweaks(net, opts.ns_tweak)
        key = (scen_name, model)
        if opts.tcp_repeats > 0 and not sc.dynamic and key not in TCP_CACHE:
            TCP_CACHE[key] = tcp_baseline(
                net, plan_link_bytes(list(net.rates), total_bytes), opts.tcp_repeats
            )
            if opts.tcp_pace > 0:  # the same, every flow paced to end at bound / margin
                TCP_PACED_CACHE[key] = tcp_baseline(
                    net,
                    plan_link_bytes(list(net.rates), total_bytes),
                    opts.tcp_repeats,
                    bound(list(net.rates), total_bytes) / opts.tcp_pace,
                )
        done = threading.Event()
        mon = None
        if opts.monitor_node is not None:
            mon = threading.Thread(
                target=tc_monitor, args=(net, opts.monitor_node, run_dir, done), daemon=True
            )
            mon.start()

        def drive() -> None:  # re-draw the rates every period, from the first measured iteration
            flag = run_dir / "measure_start"
            while not done.is_set():
                if flag.exists():
                    net.start_dynamic(
                        on_change=lambda e, r: changes.append((time.time(), e, list(r)))
                    )
                    return
                done.wait(0.05)

        th = None
        if sc.dynamic:
            th = threading.Thread(target=drive, daemon=True)
            th.start()
        launcher = Launcher(spec, out=logf)
        watchdog = threading.Timer(opts.run_timeout, launcher.stop_all)  # a hung run
        watchdog.daemon = True
        watchdog.start()
        rc = launcher.run()
        watchdog.cancel()
        done.set()
        if th is not None:
            th.join(5)
        drops = tc_drops(net)
        tcp_counts = tcp_counters(net)
    (run_dir / "tc_drops.json").write_text(json.dumps(drops))
    (run_dir / "tcp_counters.json").write_text(json.dumps(tcp_counts))
    wall = time.time() - t_begin
    if rc == 130:  # Ctrl-C: the launcher stopped the cluster; stop the benchmark too
        raise KeyboardInterrupt
    if rc != 0:
        tail = (run_dir / "launch.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"{run_dir.name}: cluster exited {rc}:\n" + "\n".join(tail))

    run = load_run(run_dir)
    summ = summarize_run(run)
    per_iter = []
    prev_end = None
    for i in range(opts.iters):
        recs = [r for rank in run.ranks for r in run.records[rank] if r["iter"] == i]
        if len(recs) != n:
            continue
        # the iteration's communication time: the period between the last worker finishing
        # iteration i-1 and the last finishing i, less the compute sleep. With pipelined
        # balance reports the workers are not aligned at the start of an iteration, so one
        # worker's push+pull span also holds its wait for the others; the period does not.
        slowest = max(r["comm_s"] for r in recs)
        end = max(r["t_end_unix"] for r in recs)
        if prev_end is None:
            comm = slowest
        else:
            comm = end - prev_end - median(r["compute_s"] for r in recs)
        prev_end = end
        mid = (min(r["t_comm_unix"] for r in recs) + max(r["t_end_unix"] for r in recs)) / 2
        lb = bound(rates_at(changes, mid), total_bytes)
        r0 = next(r for r in recs if r["rank"] == 0)
        per_iter.append(
            {
                "iter": i,
                "comm_s": comm,
                "comm_slowest_worker_s": slowest,
                "lower_bound_s": lb,
                "ratio": comm / lb,
                "srit_s": r0["srit_s"],
                "overhead_s": r0["overhead_s"],
                "overhead_max_s": max(r["overhead_s"] for r in recs),
                "shares": r0.get("plan"),
                "rates_mbit": rates_at(changes, mid),
                # which draw of the rates the iteration ran under (0: the first)
                "rate_epoch": sum(1 for tc, _, _ in changes[1:] if tc <= mid),
            }
        )
    # dynamic: of the iterations after a re-draw of the rates (not the first draw's), those
    # that ran at least SETTLE_ITERS iterations after it (the plans had time to follow) and
    # the first ones
    since: list[int] = []
    for k, p in enumerate(per_iter):
        same = k > 0 and p["rate_epoch"] == per_iter[k - 1]["rate_epoch"]
        since.append(since[-1] + 1 if same else 0)
    redrawn = [(p["ratio"], k) for p, k in zip(per_iter, since, strict=True) if p["rate_epoch"]]
    settled = [r for r, k in redrawn if k >= SETTLE_ITERS]
    fresh = [r for r, k in redrawn if k < SETTLE_ITERS]
    ok = all(r.get("value_ok", True) for r in run.iter_records())
    warm = json.loads((run_dir / "warmup.json").read_text())
    srit = [p["srit_s"] for p in per_iter]
    row = {
        "scenario": scen_name,
        "model": model,
        "scheme": scheme,
        "asrit_s": summ["asrit_s"],
        "speed_samples_per_min": summ["speed_samples_per_min"],
        "comm_time_s": median(p["comm_s"] for p in per_iter),
        "lower_bound_s": median(p["lower_bound_s"] for p in per_iter),
        "ratio_to_bound": median(p["ratio"] for p in per_iter),
        # dynamic: the median ratio of the iterations SETTLE_ITERS or more after a re-draw,
        # and of the ones before that (None without a re-draw)
        "ratio_settled": median(settled) if settled else None,
        "ratio_after_change": median(fresh) if fresh else None,
        # raw TCP moving the optimal plan's bytes in the same namespaces (same run)
        "tcp_baseline_s": median(TCP_CACHE.get((scen_name, model), [])),
        "tcp_baseline_runs_s": TCP_CACHE.get((scen_name, model)),
        # the same with every flow paced to end at the bound (--tcp-pace margin)
        "tcp_paced_runs_s": TCP_PACED_CACHE.get((scen_name, model)),
        "tcp_pace_margin": opts.tcp_pace or None,
        # extras
        "slice_elems": slice_elems,
        "tcp_cc": tcp_cc_of(sc),
        "nodes": n,
        "batch_size": opts.batch_size,
        "model_bytes": int(total_bytes),
        "scale_factor": scale,
        "iterations": len(per_iter),
        "srit_median_s": median(srit),
        "comm_time_mean_s": float(np.mean([p["comm_s"] for p in per_iter])) if per_iter else None,
        "overhead_ratio": summ["overhead_ratio"],
        "overhead_median_s": median(p["overhead_s"] for p in per_iter),
        "final_shares": per_iter[-1]["shares"] if per_iter else None,
        "rates_mbit_start": [round(r, 2) for r in changes[0][2]],
        "rate_changes": len(changes) - 1,
        "warmup_srit_s": [w["srit_s"] for w in warm],
        "values_correct": ok,
        "run_wall_s": wall,
        "tc_drops": drops,
        "run_dir": str(run_dir),
        **estimate_quality(run, changes, n),
        "per_iteration": per_iter,
    }
    return row


SETTLE_ITERS = 5  # iterations after a re-draw of the rates before a run counts as settled


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


TABLE_HEAD = [
    "scenario",
    "model",
    "scheme",
    "ASRIT s",
    "samples/min",
    "comm s",
    "bound s",
    "ratio",
    "ovh %",
]


def table_row(r: dict) -> list[str]:
    return [
        r["scenario"],
        r["model"],
        r["scheme"] + (f" x={r['slice_elems']}" if r.get("sweep") else ""),
        fmt(r["asrit_s"]),
        fmt(r["speed_samples_per_min"], ".0f"),
        fmt(r["comm_time_s"]),
        fmt(r["lower_bound_s"]),
        fmt(r["ratio_to_bound"], ".2f"),
        fmt(100 * r["overhead_ratio"] if r["overhead_ratio"] is not None else None, ".2f"),
    ]


def goals(results: list[dict], opts: argparse.Namespace) -> list[str]:
    """The issue's goals, met or missed, with the numbers."""
    from _common import median

    out = []
    main = [r for r in results if not r.get("sweep")]

    def rows(scen=None, scheme=None):
        return [
            r
            for r in main
            if (scen is None or r["scenario"] == scen) and (scheme is None or r["scheme"] == scheme)
        ]

    for scheme, lim in (("optimal", 1.10), ("aware", 1.20)):
        for scen in ("static", "dynamic", "homogeneous"):
            rs = rows(scen, scheme)
            if not rs:
                continue
            worst = max(r["ratio_to_bound"] for r in rs)
            ok = "MET" if worst <= lim else "MISSED"
            detail = ", ".join(f"{r['model']} {r['ratio_to_bound']:.2f}" for r in rs)
            out.append(f"{scheme} within {lim:.2f}x of the bound ({scen}): {ok} ({detail})")
    for scheme, lim in (("optimal", 1.10), ("aware", 1.20)):
        for scen in ("static", "homogeneous"):
            rs = [r for r in rows(scen, scheme) if r.get("tcp_baseline_s")]
            if not rs:
                continue
            ratios = [(r["model"], r["comm_time_s"] / r["tcp_baseline_s"]) for r in rs]
            ok = "MET" if max(x for _, x in ratios) <= lim else "MISSED"
            detail = ", ".join(
                f"{m} {x:.2f} (tcp {r['tcp_baseline_s']:.2f} s)"
                for (m, x), r in zip(ratios, rs, strict=True)
            )
            out.append(
                f"{scheme} within {lim:.2f}x of raw TCP moving the optimal plan's bytes "
                f"({scen}): {ok} ({detail})"
            )
    seen = set()
    for r in rows("static", None):
        if r.get("tcp_paced_runs_s") and r["model"] not in seen:
            seen.add(r["model"])
            t = float(median(r["tcp_paced_runs_s"]))
            out.append(
                f"diagnostic: raw TCP with every flow paced to {r['tcp_pace_margin']:g}x its "
                f"share of the bound ({r['model']}): {t:.2f} s, {t / r['lower_bound_s']:.2f}x "
                f"the bound (unpaced {r['tcp_baseline_s'] / r['lower_bound_s']:.2f}x)"
            )
    sp = []
    for r in rows("static", "aware"):
        avg = [a for a in rows("static", "average") if a["model"] == r["model"]]
        if avg:
            sp.append((r["model"], avg[0]["asrit_s"] / r["asrit_s"]))
    if sp:
        ok = "MET" if min(s for _, s in sp) >= 1.5 else "MISSED"
        out.append(
            "aware >= 1.5x faster than average (static): "
            + ok
            + " ("
            + ", ".join(f"{m} {s:.2f}x" for m, s in sp)
            + ")"
        )
    for variant in ("aware-robust", "optimal-robust", "optimal-oracle"):
        sp = []
        for r in rows("static", variant):
            avg = [a for a in rows("static", "average") if a["model"] == r["model"]]
            if avg:
                sp.append(
                    f"{r['model']} {avg[0]['asrit_s'] / r['asrit_s']:.2f}x "
                    f"(ratio to bound {r['ratio_to_bound']:.2f})"
                )
        if sp:
            out.append(
                f"diagnostic, not hetps as shipped: {variant} vs average (static): " + ", ".join(sp)
            )
    for r in rows("homogeneous"):
        if r["scheme"] in ("aware", "optimal", "elastic", "aware-robust"):
            ovh = 100 * (r["overhead_ratio"] or 0.0)
            out.append(
                f"overhead < 3% on a homogeneous network, {r['scheme']} {r['model']}: "
                f"{'MET' if ovh < 3 else 'MISSED'} ({ovh:.2f}% of the run in rebalance())"
            )
    fixed = rows("homogeneous", "average-fixed")
    if fixed:
        for r in rows("homogeneous"):
            if r["scheme"] in ("aware", "optimal", "average"):
                f = [x for x in fixed if x["model"] == r["model"]]
                if f:
                    d = 100 * (r["asrit_s"] / f[0]["asrit_s"] - 1)
                    out.append(
                        f"homogeneous ASRIT {r['scheme']} vs average-fixed "
                        f"(never re-plans), {r['model']}: {d:+.1f}%"
                    )
    _ = median
    return out


def draw_figures(figdir: Path, groups: dict[str, list[str]]) -> list[str]:
    """``hetps plot`` on chosen run directories, copied into one temporary LOGDIR per figure.
    The copies live outside ``logdir``: inside it, ``hetps plot LOGDIR`` and ``hetps summary
    LOGDIR`` would find every run twice."""
    import tempfile

    from hetps.metrics.plot import plot

    written = []
    figdir.mkdir(parents=True, exist_ok=True)
    for fig, dirs in groups.items():
        if not dirs:
            continue
        with tempfile.TemporaryDirectory(prefix=f"hetps-lb-{fig}-") as staging:
            tmp = Path(staging)
            for d in dirs:
                src = Path(d)
                shutil.copytree(
                    src,
                    tmp / src.parent.name / src.name,
                    ignore=shutil.ignore_patterns("launch.log"),
                )
            res = plot(tmp, out=figdir, only=[fig])
        written += [str(p) for p in res.written]
        for note in res.notes:
            print("plot:", note)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--oracle-scheduler", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--robust-scheduler", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tcp-peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--tcp-repeats",
        type=int,
        default=3,
        help="raw-TCP baseline transfers per static scenario and model (0: none)",
    )
    ap.add_argument(
        "--tcp-pace",
        type=float,
        default=0.0,
        help="also run the raw-TCP baseline with every flow paced by the kernel at this "
        "margin times (its bytes / the bound), e.g. 0.95 (0: not)",
    )
    ap.add_argument(
        "--robust",
        nargs="*",
        default=[],
        help="also run these schemes with an early planner fix (a test of it), superseded by "
        "the planner itself (per-round median link estimates "
        "and hysteresis; scheme name + '-robust'); none to skip",
    )
    ap.add_argument(
        "--oracle",
        nargs="*",
        default=["optimal"],
        help="static scenario: also run these schemes with the planner given the "
        "true rates (diagnostic, scheme name + '-oracle'); none to skip",
    )
    ap.add_argument("--quick", action="store_true", help="4 nodes, mobilenet-v1, few iterations")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--logdir", default="runs/load_balance", help="run logs (hetps metrics)")
    ap.add_argument(
        "--figures",
        default=None,
        help="figure directory (default: docs/figures/balance, or LOGDIR/figures with --quick)",
    )
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--schemes", nargs="*", default=list(SCHEMES))
    ap.add_argument("--scenarios", nargs="+", default=["static", "dynamic", "homogeneous"])
    ap.add_argument("--lo", type=float, default=10.0, help="lowest drawn rate, Mbit/s")
    ap.add_argument("--hi", type=float, default=100.0, help="rate cap, Mbit/s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--period", type=float, default=10.0, help="dynamic: re-draw period, s")
    ap.add_argument("--homo", type=float, default=50.0, help="homogeneous rate, Mbit/s")
    ap.add_argument(
        "--tcp-cc",
        default="reno",
        help="TCP congestion control inside the nodes ('host': the host's default, which is "
        "bbr on this project's machines; docs/NETEM.md, 'TCP congestion control')",
    )
    ap.add_argument(
        "--target-s",
        type=float,
        default=1.5,
        help="scale every model so the static scenario's lower bound is this",
    )
    ap.add_argument("--iters", type=int, default=8, help="measured iterations per run")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured first iterations")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per worker and iteration")
    ap.add_argument(
        "--compute-s",
        type=float,
        default=0.0,
        help="emulated compute per iteration (sleep); 0 = communication only",
    )
    ap.add_argument(
        "--slice-elems",
        type=int,
        default=SLICE_ELEMS,
        help=f"slice size in elements (default {SLICE_ELEMS}: the optimum of the granularity "
        "model fitted to an ASRIT-vs-slice-size sweep on this benchmark's network, "
        "docs/BALANCE.md §10.7)",
    )
    ap.add_argument("--sweep-model", default="resnet50-v1")
    ap.add_argument("--sweep-scheme", default="aware")
    ap.add_argument(
        "--sweep-sizes",
        type=int,
        nargs="*",
        default=[1 << 11, 1 << 15],
        help="extra slice sizes for the sweep (static scenario); none to skip",
    )
    ap.add_argument(
        "--pack",
        type=int,
        default=0,
        help="fuse consecutive keys below this many elements into one key "
        "(gradient buckets); 0 = the model's own keys",
    )
    ap.add_argument(
        "--dump-samples",
        action="store_true",
        help="log every link sample the workers report (samples-<r>.jsonl)",
    )
    ap.add_argument(
        "--stamps",
        action="store_true",
        help="diagnostics: log when every request left and every slice's push and pull were "
        "answered (stamps-<r>.jsonl)",
    )
    ap.add_argument(
        "--pushpull",
        action="store_true",
        help="workers exchange each key with one pushpull instead of a push and a pull",
    )
    ap.add_argument("--no-hash", action="store_true", help="skip the mxnet-hash baseline")
    ap.add_argument(
        "--snapshot",
        nargs="?",
        const="HEAD",
        default=None,
        metavar="REV",
        help="run hetps from `git archive REV src` (default HEAD; a tree others are editing "
        "cannot change under a run); the commit goes into the results",
    )
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--ns-tweak",
        nargs="*",
        default=[],
        choices=["noidle", "shortq", "ackprio", "fairq"],
        help="diagnostic changes to TCP/queueing in the run's namespaces",
    )
    ap.add_argument(
        "--homo-schemes",
        nargs="*",
        default=["average-fixed", "average", "aware", "optimal"],
        help="schemes of the homogeneous scenario (first model only)",
    )
    ap.add_argument("--only", nargs="*", default=None, help="run only these schemes")
    ap.add_argument(
        "--update",
        default=None,
        help="a --json file of an earlier run: keep its results except those run now",
    )
    ap.add_argument(
        "--monitor-node",
        type=int,
        default=None,
        help="diagnostics: sample node N's TBF counters every 0.1 s (tc_monitor.jsonl); -1: "
        "every node's bytes and queues every ~0.1 s (link_monitor.jsonl)",
    )
    ap.add_argument(
        "--run-timeout",
        type=float,
        default=420.0,
        help="stop a run that takes longer than this (s)",
    )
    opts = ap.parse_args(argv)
    if opts.worker:
        return worker_main()
    if opts.tcp_peer:
        return tcp_peer_main(opts.tcp_peer)
    if opts.oracle_scheduler:
        return oracle_scheduler_main()
    if opts.robust_scheduler:
        return robust_scheduler_main()
    commit = None
    try:
        import subprocess

        commit = subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", opts.snapshot or "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(HERE.parent), "status", "--porcelain", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        dirty = ""
    if opts.snapshot and commit:
        snap = Path(opts.logdir).resolve() / "_src" / commit[:12]
        if not (snap / "src" / "hetps").exists():
            snap.mkdir(parents=True, exist_ok=True)
            arch = subprocess.run(
                ["git", "-C", str(HERE.parent), "archive", commit, "src"],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(snap)], input=arch, check=True)
        opts.src = str(snap / "src")
        sys.path.insert(0, opts.src)
        dirty = ""
    print(
        f"hetps: commit {commit}{' + uncommitted src changes' if dirty else ''}"
        f"{' (snapshot ' + opts.src + ')' if opts.src else ''}",
        flush=True,
    )
    if opts.quick:
        opts.nodes = 4
        opts.models = ["mobilenet-v1"] if opts.models == list(MODELS) else opts.models
        opts.iters = min(opts.iters, 6)
        opts.warmup = min(opts.warmup, 2)
        opts.period = min(opts.period, 6.0)
        opts.scenarios = (
            ["static", "homogeneous"]
            if opts.scenarios == ["static", "dynamic", "homogeneous"]
            else opts.scenarios
        )
        opts.sweep_sizes = []
        opts.no_hash = True
        opts.oracle = []
        opts.robust = []
        opts.homo_schemes = ["average-fixed", "aware"]
    from _common import machine_info, markdown_table, print_table, write_json

    from hetps.netem import load_scenario
    from hetps.netem.emulator import require_root

    require_root()
    logdir = Path(opts.logdir) / ("quick" if opts.quick else "full")
    if opts.figures == "":
        figdir = None  # --figures '': no figures
    elif opts.figures:
        figdir = Path(opts.figures)
    else:
        figdir = logdir / "figures" if opts.quick else Path("docs/figures/balance")
    logdir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    load0 = os.getloadavg()
    static_sc = load_scenario(scenario_dict("static", opts), nodes=opts.nodes)
    static_rates = static_sc.rates_at(0)
    per_byte = bound(static_rates, 1.0)  # s per model byte on the static network
    print(
        f"static rates (Mbit/s): {[round(r, 1) for r in static_rates]}; "
        f"TCP congestion control {tcp_cc_of(static_sc)}; load average {load0[0]:.2f}",
        flush=True,
    )
    plans = []  # (scenario, model, scheme, slice, sweep)
    for scen in opts.scenarios:
        for model in opts.models:
            schemes = list(opts.schemes)
            if scen == "static" and not opts.no_hash:
                schemes = ["mxnet-hash"] + schemes
            if scen in ("static", "dynamic"):
                schemes += [f"{r}-robust" for r in opts.robust]
            if scen == "static":
                schemes += [f"{o}-oracle" for o in opts.oracle]
            if scen == "homogeneous":
                if model != opts.models[0] and not opts.quick:
                    continue  # overhead: one model is enough
                schemes = list(opts.homo_schemes) + [
                    f"{r}-robust" for r in opts.robust if r == "aware"
                ]
            for s in schemes:
                plans.append((scen, model, s, opts.slice_elems, False))
    if "static" in opts.scenarios and opts.sweep_model in opts.models:
        for x in opts.sweep_sizes:
            plans.append(("static", opts.sweep_model, opts.sweep_scheme, x, True))
    results = []
    old = None
    if opts.update:  # keep the earlier results of every run not re-run now
        old = json.loads(Path(opts.update).read_text())
        again = {(s, m, sc, x) for s, m, sc, x, _ in plans if not opts.only or sc in opts.only}
        for r in old["results"]:
            if (r["scenario"], r["model"], r["scheme"], r["slice_elems"]) in again:
                continue
            key = f"{r['scenario']}/{r['model']}/{r['scheme']}/x{r['slice_elems']}"
            r["per_iteration"] = old.get("per_iteration", {}).get(key, [])
            results.append(r)
    for k, (scen, model, scheme, x, sweep) in enumerate(plans):
        if opts.only and scheme not in opts.only:
            continue
        sizes0 = model_sizes(model, Path(opts.logdir) / "param_sizes.json")
        scale = sum(sizes0) * ELEM_BYTES * per_byte / opts.target_s
        sizes = pack_sizes(scale_sizes(sizes0, scale), opts.pack)
        name = f"{model}-{scheme}" + (f"-x{x}" if sweep else "")
        run_dir = logdir / ("slices" if sweep else scen) / name
        t0 = time.time()
        print(
            f"[{k + 1}/{len(plans)}] {scen} {name}: {len(sizes)} keys, "
            f"{sum(sizes) * ELEM_BYTES / 1e6:.2f} MB (1/{scale:.1f} of the model) ...",
            end=" ",
            flush=True,
        )
        try:
            row = run_one(
                opts, run_dir, scen, scenario_dict(scen, opts), model, scheme, sizes, scale, x
            )
        except KeyboardInterrupt:  # Ctrl-C: keep what the finished runs measured
            print("interrupted: writing the runs that finished", flush=True)
            break
        except Exception as exc:  # noqa: BLE001 - report, go on with the other runs
            print(f"FAILED: {exc}", flush=True)
            results.append(
                {
                    "scenario": scen,
                    "model": model,
                    "scheme": scheme,
                    "error": str(exc),
                    "slice_elems": x,
                    "sweep": sweep,
                }
            )
            continue
        row["sweep"] = sweep
        row["hetps_commit"] = commit
        results.append(row)
        print(
            f"ASRIT {row['asrit_s']:.3f} s, comm {row['comm_time_s']:.3f} s, bound "
            f"{row['lower_bound_s']:.3f} s, ratio {row['ratio_to_bound']:.2f}, overhead "
            f"{100 * (row['overhead_ratio'] or 0):.2f}% ({time.time() - t0:.0f} s)"
            + (
                f"; after a re-draw: {fmt(row['ratio_after_change'], '.2f')} in the first "
                f"{SETTLE_ITERS} iterations, {fmt(row['ratio_settled'], '.2f')} later"
                if row["rate_changes"]
                else ""
            ),
            flush=True,
        )
    order = {(s, m, sc, x): i for i, (s, m, sc, x, _) in enumerate(plans)}
    results.sort(
        key=lambda r: order.get(
            (r["scenario"], r["model"], r["scheme"], r["slice_elems"]), len(order)
        )
    )
    good = [r for r in results if "error" not in r]
    print()
    print_table(TABLE_HEAD, [table_row(r) for r in good])
    goal_lines = goals(good, opts)
    print()
    for g in goal_lines:
        print(g)
    fig_groups = {
        "speed_per_scheme": [
            r["run_dir"] for r in good if r["scenario"] == "static" and not r["sweep"]
        ],
        "srit_over_iterations": [
            r["run_dir"]
            for r in good
            if r["scenario"] == "dynamic" and r["scheme"] in ("average", "aware", "optimal")
        ]
        or [
            r["run_dir"]
            for r in good
            if r["scenario"] == "static" and not r["sweep"] and r["model"] == opts.models[0]
        ],
        "asrit_vs_slice_size": [
            r["run_dir"]
            for r in good
            if r["model"] == opts.sweep_model
            and r["scheme"] == opts.sweep_scheme
            and r["scenario"] == "static"
        ]
        if opts.sweep_sizes
        else [],
        "overhead": [r["run_dir"] for r in good if r["scenario"] == "homogeneous"],
    }
    written = draw_figures(figdir, fig_groups) if figdir is not None else []
    for w in written:
        print("figure:", w)
    load1 = os.getloadavg()
    out = {
        "results": [{k: v for k, v in r.items() if k != "per_iteration"} for r in results],
        "per_iteration": {
            f"{r['scenario']}/{r['model']}/{r['scheme']}/x{r['slice_elems']}": r["per_iteration"]
            for r in good
        },
        "goals": goal_lines,
        "figures": written,
        "markdown_table": markdown_table(TABLE_HEAD, [table_row(r) for r in good]),
        "settings": {k: v for k, v in vars(opts).items() if k != "worker"},
        "hetps_commit": commit,
        "hetps_src_dirty": bool(dirty),
        "static_rates_mbit": static_rates,
        "machine": machine_info(),
        "load_average": {"start": load0, "end": load1},
        "wall_s": time.time() - t_start,
    }
    if old is not None:  # an update: the settings are the first run's, plus what was re-run
        out["settings"] = old.get("settings", out["settings"])
        out["wall_s"] = old.get("wall_s", 0.0) + out["wall_s"]
        out["updates"] = old.get("updates", []) + [sys.argv[1:]]
    print(f"\nwall {out['wall_s']:.0f} s; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(opts.json, out)
        print("results:", opts.json)
    return 1 if any("error" in r or not r.get("values_correct", True) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
