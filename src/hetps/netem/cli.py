"""``hetps netem``: run a command once per emulated node, list runs, clean up (docs/NETEM.md).

CMD runs in every node's namespace with ``HETPS_NETEM_NODE``, ``HETPS_NETEM_IP``,
``HETPS_NETEM_NODES`` and ``HETPS_NETEM_IPS`` set; the first node command that exits non-zero
stops the others and its code is returned."""

from __future__ import annotations

import argparse
import logging
import queue
import sys
import threading
from collections.abc import Sequence
from typing import Any

from hetps.netem import reap
from hetps.netem.emulator import Netem
from hetps.netem.scenario import Scenario, ScenarioError, read_toml
from hetps.netem.tools import (
    BRIDGE,
    DEFAULT_PREFIX,
    NODE_IF,
    NetemError,
    cleanup_stale,
    find_tool,
    list_runs,
)

__all__ = ["add_parser", "build_parser", "main", "scenario_from_args"]

_DESCRIPTION = """\
Emulate a heterogeneous network on this machine (needs root): N Linux network namespaces on a
bridge, each node's sending and receiving rate shaped with tc. Runs CMD (after --) once per
node inside its namespace, with HETPS_NETEM_NODE, HETPS_NETEM_IP, HETPS_NETEM_NODES and
HETPS_NETEM_IPS set. Without CMD the network stays up until Ctrl-C.
Subcommands: 'hetps netem show' lists live runs, 'hetps netem cleanup' removes stale ones."""


def build_parser(prog: str = "hetps netem") -> argparse.ArgumentParser:
    """The parser for the part of the command line before ``--``."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=_DESCRIPTION,
        usage=f"{prog} [SCENARIO] [options] [-- CMD ...] | {prog} show | {prog} cleanup [--all]",
    )
    p.add_argument("scenario", nargs="?", help="scenario TOML file (or use the flags below)")
    p.add_argument("--nodes", type=int, help="number of nodes (overrides the file)")
    p.add_argument("--kind", choices=("static", "dynamic"), help="scenario kind")
    p.add_argument("--rates", help="per-node rates in Mbit/s, comma-separated: 20,80,80")
    p.add_argument("--lo", type=float, help="lowest drawn rate (Mbit/s)")
    p.add_argument("--hi", type=float, help="highest drawn rate (Mbit/s)")
    p.add_argument("--seed", type=int, help="seed of the drawn rates")
    p.add_argument("--period", type=float, help="dynamic: seconds between re-draws")
    p.add_argument("--delay-ms", type=float, help="one-way delay added at each node's egress")
    p.add_argument(
        "--tcp-cc",
        help="TCP congestion control inside every node, e.g. reno (default: the host's)",
    )
    p.add_argument("--subnet", help="IPv4 subnet for the nodes (default: a free 10.77.k.0/24)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix")
    p.add_argument("--all", action="store_true", help="cleanup: remove live runs too")
    p.add_argument("-v", "--verbose", action="store_true", help="log every change")
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``netem`` on a top-level ``add_subparsers()`` object.

    The sub-parser takes the rest of the command line verbatim (``--`` and the node command
    included) and sets ``func``, so the caller runs ``sys.exit(args.func(args))``.
    """
    p = subparsers.add_parser(
        "netem",
        help="emulate a heterogeneous network with namespaces + tc (root)",
        description=_DESCRIPTION,
        add_help=False,
        prefix_chars="\0",  # no options at this level: main() parses them
    )
    p.add_argument("netem_argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=lambda args: main(args.netem_argv))
    return p


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """Build the scenario from ``args.scenario`` (a TOML file) overridden by the flags."""
    data: dict[str, Any] = {}
    if args.scenario:
        doc = read_toml(args.scenario)
        data = dict(doc.get("network", doc)) if isinstance(doc, dict) else {}
    if args.rates is not None:
        try:
            rates = [float(x) for x in args.rates.split(",") if x.strip()]
        except ValueError as e:
            raise ScenarioError(f"--rates {args.rates!r}: {e}; fix: --rates 20,80,80") from e
        data["rates_mbit"] = rates
        data.pop("lo_mbit", None)
        data.pop("hi_mbit", None)
    for flag, key in (("lo", "lo_mbit"), ("hi", "hi_mbit"), ("seed", "seed"),
                      ("period", "period_s"), ("delay_ms", "delay_ms"),
                      ("tcp_cc", "tcp_cc")):  # fmt: skip
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
            if key.endswith("_mbit"):  # drawn rates instead of given ones
                data.pop("rates_mbit", None)
    if args.kind is not None:
        data["kind"] = args.kind
    elif "kind" not in data:
        data["kind"] = "dynamic" if "period_s" in data else "static"
    if args.nodes is not None and "rates_mbit" in data:
        data.pop("nodes", None)
    if not data.get("rates_mbit") and "lo_mbit" not in data and "pair_rates_mbit" not in data:
        raise ScenarioError(
            "netem: no rates; fix: give a scenario file, --rates 20,80,... or --lo/--hi/--nodes"
        )
    return Scenario.from_dict(data, nodes=args.nodes)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hetps netem``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        k = argv.index("--")
        head, cmd = argv[:k], argv[k + 1 :]
    else:
        head, cmd = argv, []
    parser = build_parser()
    args = parser.parse_args(head)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        if args.scenario == "show" and not cmd:
            return _show(args.prefix)
        if args.scenario == "cleanup" and not cmd:
            removed = cleanup_stale(args.prefix, force=args.all)
            print(f"removed {len(removed)} namespace(s)" + "".join(f"\n  {n}" for n in removed))
            return 0
        scenario = scenario_from_args(args)
        return _run(scenario, cmd, subnet=args.subnet, prefix=args.prefix)
    except (ScenarioError, NetemError) as e:
        _say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130


def _run(scenario: Scenario, cmd: list[str], *, subnet: str | None, prefix: str) -> int:
    try:
        with Netem(scenario, subnet=subnet, prefix=prefix, handle_signals=True) as net:
            if scenario.dynamic:
                net.start_dynamic(lambda epoch, rates: _say(f"epoch {epoch}: rates {_mbit(rates)}"))
            for i in range(net.n):
                ip, rate = net.node_ip(i), _mbit(net.rates[i : i + 1])
                _say(f"node {i}: ns {net.node_ns(i)} ip {ip} rate {rate}")
            if not cmd:
                _say("network up; Ctrl-C to remove it")
                threading.Event().wait()  # until SIGINT/SIGTERM (handlers close the network)
                return 0
            return _run_nodes(net, cmd)
    except SystemExit as e:  # SIGTERM handler, after the network was removed
        return int(e.code) if isinstance(e.code, int) else 1


def _run_nodes(net: Netem, cmd: list[str]) -> int:
    procs = [net.popen(i, cmd, env=net.node_env(i)) for i in range(net.n)]
    done: queue.Queue[tuple[int, int]] = queue.Queue()

    for i, p in enumerate(procs):
        threading.Thread(target=lambda i=i, p=p: done.put((i, p.wait())), daemon=True).start()
    for _ in procs:
        i, code = done.get()
        if code != 0:
            _say(f"node {i} exited with {code}; stopping the others")
            return code if code > 0 else 128 - code  # (leaving the Netem block stops them)
    return 0


def _say(text: str) -> None:
    print(f"hetps netem: {text}", file=sys.stderr, flush=True)


def _mbit(rates: list[float]) -> str:
    return ", ".join(f"{r:.1f}" for r in rates) + " Mbit/s"


def _show(prefix: str) -> int:
    ip, tc = find_tool("ip"), find_tool("tc")
    if ip is None:
        _say("ip (iproute2) not found")
        return 1
    runs = list_runs(prefix, ip=ip)
    if not runs:
        print(f"no hetps netem namespaces (prefix {prefix!r})")
        return 0
    for run in runs:
        state = "alive" if run.alive else "STALE: remove with 'hetps netem cleanup'"
        print(f"run {run.run_id}  owner pid {run.pid} ({state})")
        hub = f"{run.run_id}-hub"
        for ns in run.namespaces:
            if ns == hub:
                print(f"  {ns}  bridge {BRIDGE}")
                continue
            idx = ns.rsplit("-n", 1)[1]
            addr = _first(_out(ip, ns, "-o", "-4", "addr", "show", "dev", NODE_IF), "inet")
            egress = _root_rate(_out(tc, ns, "qdisc", "show", "dev", NODE_IF))
            ingress = _root_rate(_out(tc, hub, "qdisc", "show", "dev", f"v{idx}"))
            print(f"  {ns}  {addr or '-'}  egress {egress}  ingress {ingress}")
    return 0


def _out(tool: str | None, ns: str, *argv: str) -> str | None:
    """``tool -n ns argv``'s output (None without the tool)."""
    return reap.quiet([tool, "-n", ns, *argv]).stdout if tool else None


def _first(text: str, key: str) -> str | None:
    toks = text.split()
    return next((b for a, b in zip(toks, toks[1:], strict=False) if a == key), None)


def _root_rate(text: str | None) -> str:
    if text is None:
        return "?"
    for line in text.splitlines():
        if line.startswith("qdisc tbf 1: root"):
            return _first(line, "rate") or "?"
    return "-"


if __name__ == "__main__":
    sys.exit(main())
