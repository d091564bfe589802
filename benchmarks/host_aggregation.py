"""Host-local aggregation on emulated hosts: bytes on each worker host's interface and round
time, with the host's sum pushed once (HETPS_HOST_AGGREGATION=1) against every worker pushing
its own (=0), in the same run (docs/HOSTS.md).

Every run is a real secured hetps cluster (``hetps launch``'s launcher, a fresh secret) in
network namespaces of ``hetps.netem`` (root): node 0 holds the scheduler and the servers,
nodes 1..H each hold K workers (the host contract set per worker: ``HETPS_HOST_GROUP``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), every node's link shaped to the same rate both ways.
The workers push and pull one key of ``--mb`` MB (``dist_sync``, split over the servers)
for ``--rounds`` rounds after one warm-up round. Reported per setting, alternated A B A B
over ``--repeats``:

- **bytes/round** of each worker host: its ``eth0`` counters (sent + received) over the
  measured rounds, divided by the rounds, and that over one push and one pull of the model;
- **round**: the median over rounds of the slowest worker's push + pull;
- **bound**: the busiest link's bytes of a round, push and pull (the servers' host: H host
  pushes in, then H pulls out with aggregation; H x K each without), over its rate, and
  round / bound;
- **payload**: what the host's workers' vans sent and received (the arrays and headers,
  before TCP/IP), over one push and one pull.

    .venv/bin/python benchmarks/host_aggregation.py                  # 2 hosts x 3, 300 Mbit/s
    .venv/bin/python benchmarks/host_aggregation.py --json out.json --repeats 2
    .venv/bin/python benchmarks/host_aggregation.py --mtu 9000     # jumbo frames
    .venv/bin/python benchmarks/host_aggregation.py --table 64     # a row-sparse table

``--table C``: a table of ``--rows`` x C float32 instead of the key: each worker pushes and
pulls ``--ids`` distinct ids a round, ``--share`` of them its host's common ids and the rest
its own; "one push + one pull" is then the host's merged ids and rows, each way.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

WORKER = """
import json, os, time
import numpy as np
import hetps.kv

def nic():
    base = '/sys/class/net/eth0/statistics/'
    return sum(int(open(base + f).read()) for f in ('tx_bytes', 'rx_bytes'))

def van():
    return sum(kv.node.van.counters.totals())

n, rounds = int(os.environ['HA_ELEMS']), int(os.environ['HA_ROUNDS'])
kv = hetps.kv.create('dist_sync')
h, k = kv.cfg.host_group, kv.cfg.local_world_size
unit = []  # a round's one push + one pull of the host: the model's, or its merged ids'
if os.environ.get('HA_TABLE'):
    from hetps.tables.rowsparse import Table
    rows, cols, share = os.environ['HA_TABLE'].split(',')
    rows, cols, share = int(rows), int(cols), float(share)
    kv.init('t', Table(rows, cols))

    def ids_of(r, local):  # the host's share of a worker's n ids, the rest its own
        mine = int(share * n)
        common = np.random.default_rng([r, h]).choice(rows, mine, replace=False)
        own = np.random.default_rng([r, h, local + 1]).choice(rows, n - mine, replace=False)
        return np.unique(np.concatenate([common, own]))

    def step(r):
        ids = ids_of(r, kv.cfg.local_rank)
        kv.push('t', (ids, np.ones((ids.size, cols), np.float32)))
        kv.row_sparse_pull('t', row_ids=ids)
        union = np.unique(np.concatenate([ids_of(r, lr) for lr in range(k)]))
        unit.append(2 * union.size * (8 + 4 * cols))  # ids and rows, each way
else:
    kv.init('w', np.zeros(n, np.float32))
    g = np.random.default_rng(kv.rank).standard_normal(n).astype(np.float32)
    out = np.empty(n, np.float32)

    def step(r):
        kv.push('w', g)
        kv.pull('w', out=out)
        unit.append(2 * 4 * n)

step(rounds)                                     # warm-up round
kv.barrier()
b0, v0, unit = nic(), van(), []
times = []
for r in range(rounds):
    t0 = time.perf_counter()
    step(r)
    times.append(time.perf_counter() - t0)
kv.barrier()
b1, v1 = nic(), van()
print('HA ' + json.dumps({'host': h, 'local': kv.cfg.local_rank,
      'on': kv.hostagg is not None, 'bytes': b1 - b0, 'van': v1 - v0, 'times': times,
      'unit': sum(unit) / len(unit)}), flush=True)
"""


def set_mtu(net, mtu: int) -> None:
    """Every link of the emulated cluster at ``mtu`` bytes (each node's eth0, its peer on
    the hub's bridge, the bridge), as a cluster with jumbo frames (9000) has them."""
    import subprocess

    from hetps.netem.tools import BRIDGE, NODE_IF

    if mtu == 1500:
        return
    for i in range(net.n):
        subprocess.run(["ip", "-n", net.hub, "link", "set", "dev", f"v{i}", "mtu", str(mtu)],
                       check=True)  # fmt: skip
        subprocess.run(["ip", "-n", net.node_ns(i), "link", "set", "dev", NODE_IF, "mtu",
                        str(mtu)], check=True)  # fmt: skip
    subprocess.run(["ip", "-n", net.hub, "link", "set", "dev", BRIDGE, "mtu", str(mtu)],
                   check=True)  # fmt: skip


def floor(mtu: int) -> dict:
    """What TCP/IP over Ethernet adds to a payload at ``mtu``, as an interface counts it:
    each full segment carries MSS = MTU - 20 (IPv4) - 32 (TCP with timestamps) bytes in a
    frame of MTU + 14 (Ethernet header) bytes, and the other direction sends a 66-byte ACK
    frame for every second segment (Linux's delayed ACK), or for far fewer (GRO, stretch
    ACKs): the floor without ACKs and with one per two segments."""
    mss = mtu - 20 - 32
    data = (mtu + 14) / mss
    return {"mss": mss, "no_acks": data, "ack_per_2": data + 66 / (2 * mss)}


def run_once(args, agg: bool, script: Path) -> dict:
    """One cluster on emulated hosts; its figures."""
    from hetps.launch.contract import LaunchSpec
    from hetps.launch.local import Launcher
    from hetps.netem import Netem

    hosts, k = args.hosts, args.per_host
    n = int(args.mb * 1e6) // 4 if args.table is None else args.ids
    env = {
        "HETPS_HOST_AGGREGATION": "1" if agg else "0",
        "HA_ELEMS": str(n),
        "HA_ROUNDS": str(args.rounds),
        "PS_HEARTBEAT_TIMEOUT": "60",
        "HETPS_REQUEST_TIMEOUT": "300",
        "OMP_NUM_THREADS": "1",
    }
    if args.table is not None:  # a table of --table columns, --ids ids per worker a round
        env["HA_TABLE"] = f"{args.rows},{args.table},{args.share}"
    out = io.StringIO()
    with Netem([args.rate] * (hosts + 1)) as net:
        set_mtu(net, args.mtu)
        spec = LaunchSpec(
            num_workers=hosts * k,
            num_servers=args.servers,
            command=[sys.executable, str(script)],
            env=env,
            start_timeout=120,
        )
        spec.host = net.node_ip(0)

        def wrap(role: str, rank: int, argv: list[str], penv: dict[str, str]):
            node = 1 + rank // k if role == "worker" else 0
            penv = dict(penv)
            penv["DMLC_NODE_HOST"] = net.node_ip(node)
            penv["DMLC_PS_ROOT_URI"] = net.node_ip(0)
            if role == "worker":
                penv.update(
                    HETPS_HOST_GROUP=str(rank // k),
                    LOCAL_RANK=str(rank % k),
                    LOCAL_WORLD_SIZE=str(k),
                )
            return net.exec_argv(node, argv), penv

        spec.wrap = wrap
        rc = Launcher(spec, out=out).run()
    text = out.getvalue()
    if rc != 0:
        raise SystemExit(f"the run with aggregation {'on' if agg else 'off'} failed:\n{text}")
    recs = [json.loads(m) for m in re.findall(r"HA (\{.*\})", text)]
    assert len(recs) == hosts * k, text
    assert all(r["on"] == agg for r in recs), recs
    model = recs[0]["unit"] / 2  # (a table's: its host's merged push, ids and rows)
    per_host, payload = {}, {}
    for r in recs:
        unit = r["unit"]
        payload[r["host"]] = payload.get(r["host"], 0) + r["van"] / args.rounds / unit
    for r in recs:
        if r["local"] == 0:  # (every worker of a host reads the same interface)
            per_host[r["host"]] = (r["bytes"] / args.rounds, r["unit"])
    rounds = [max(r["times"][i] for r in recs) for i in range(args.rounds)]
    senders = hosts if agg else hosts * k  # pushes into the servers' host per round
    bound = 2 * senders * model * 8 / (args.rate * 1e6)  # its pushes in, then the pulls out
    if args.table is not None:  # (a table's: what every worker's van moved, over the rate)
        bound = sum(r["van"] for r in recs) / args.rounds * 8 / (args.rate * 1e6)
    med = statistics.median(rounds)
    return {
        "aggregation": agg,
        "host_bytes_per_round": {h: b for h, (b, _) in per_host.items()},
        "host_bytes_over_push_pull": {h: b / u for h, (b, u) in per_host.items()},
        "payload_over_push_pull": payload,
        "round_s": med,
        "bound_s": bound,
        "round_over_bound": med / bound,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="worker hosts")
    p.add_argument("--per-host", type=int, default=3, help="workers per host")
    p.add_argument("--servers", type=int, default=2, help="servers (on their own host)")
    p.add_argument("--rate", type=float, default=300.0, help="every link's rate, Mbit/s")
    p.add_argument("--mb", type=float, default=16.0, help="the model, MB (float32)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per run")
    p.add_argument("--repeats", type=int, default=1, help="runs per setting, alternated")
    p.add_argument("--mtu", type=int, default=1500, help="every link's MTU (9000: jumbo frames)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--table", type=int, help="a row-sparse table of this many columns instead")
    p.add_argument("--rows", type=int, default=1_000_000, help="the table's rows")
    p.add_argument("--ids", type=int, default=20_000, help="ids a worker pushes and pulls")
    p.add_argument("--share", type=float, default=0.5, help="of them, the host's common ids")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetps-hostagg-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        runs = []
        for _ in range(args.repeats):
            for agg in (True, False):
                runs.append(run_once(args, agg, script))
                r = runs[-1]
                print(
                    f"aggregation {'on ' if agg else 'off'}: round {r['round_s']:.3f} s "
                    f"(bound {r['bound_s']:.3f} s, x{r['round_over_bound']:.2f}); bytes/round "
                    "per host over one push + pull: "
                    + ", ".join(f"{v:.3f}" for v in r["host_bytes_over_push_pull"].values())
                    + " (payload "
                    + ", ".join(f"{v:.3f}" for v in r["payload_over_push_pull"].values())
                    + ")",
                    flush=True,
                )
    on = [r for r in runs if r["aggregation"]]
    off = [r for r in runs if not r["aggregation"]]
    summary = {
        "setup": vars(args),
        "runs": runs,
        "round_on_s": statistics.median(r["round_s"] for r in on),
        "round_off_s": statistics.median(r["round_s"] for r in off),
        "bytes_on_over_push_pull": max(
            v for r in on for v in r["host_bytes_over_push_pull"].values()
        ),
        "bytes_off_over_push_pull": max(
            v for r in off for v in r["host_bytes_over_push_pull"].values()
        ),
    }
    summary["speedup"] = summary["round_off_s"] / summary["round_on_s"]
    summary["tcp_floor"] = floor(args.mtu)
    summary["on_over_bound"] = statistics.median(r["round_over_bound"] for r in on)
    print(
        f"\n{args.hosts} hosts x {args.per_host} workers, {args.servers} servers, "
        + (
            f"{args.mb:g} MB"
            if args.table is None
            else f"a table of {args.table} columns, "
            f"{args.ids} ids a worker, {args.share:g} of them its host's"
        )
        + f", {args.rate:g} Mbit/s, secured\n"
        f"round: on {summary['round_on_s']:.3f} s, off {summary['round_off_s']:.3f} s, "
        f"speedup x{summary['speedup']:.2f}; on / bound x{summary['on_over_bound']:.2f}\n"
        f"worker host bytes per round over one push + pull: on "
        f"{summary['bytes_on_over_push_pull']:.3f}, off {summary['bytes_off_over_push_pull']:.3f}"
        f"\nTCP/IP's floor at MTU {args.mtu} (MSS {summary['tcp_floor']['mss']}): "
        f"{summary['tcp_floor']['no_acks']:.4f} without ACKs, "
        f"{summary['tcp_floor']['ack_per_2']:.4f} with an ACK per two segments"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
