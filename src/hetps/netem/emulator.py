"""Kernel network emulator: namespaces + veth + bridge + ``tc`` shaping (docs/NETEM.md has
the topology and how rates are applied). (docs/MODULES.md, "hetps.netem.emulator")"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from hetps.netem import reap
from hetps.netem.dynamic import DynamicDriver
from hetps.netem.scenario import Scenario
from hetps.netem.tools import (  # noqa: F401 - re-exported
    BRIDGE,
    CLASSIFY,
    DEFAULT_PREFIX,
    FRAME,
    GOODPUT_FACTOR,
    NODE_IF,
    TCP_CC_FILE,
    NetemError,
    NetemPermissionError,
    NetemUnsupportedError,
    bits,
    find_tool,
    pick_subnet,
    read_sysctl,
    require_root,
    run_tool,
    tbf_params,
)

log = logging.getLogger("hetps.netem")


class Netem:
    """N network namespaces on one bridge, each node's sending/receiving rate shaped by tc.

    Use as a context manager::

        with Netem(Scenario.static([20, 80, 80])) as net:
            srv = net.popen(1, ["python", "server.py", "--bind", net.node_ip(1)])
            ...

    Args:
        scenario: a :class:`Scenario`, or a list of per-node rates (Mbit/s) for a static one.
        subnet: IPv4 /24 (or larger) for the nodes; default the first ``10.77.k.0/24`` that
            does not overlap the caller's own addresses or routes.
        prefix: lowercase letters starting every namespace name (default ``hps``).
        reaper: start a guard process that removes everything if this process is SIGKILLed.
        handle_signals: install SIGINT/SIGTERM handlers that close the emulator and then
            behave as before (the previous Python handler, else KeyboardInterrupt for SIGINT
            and ``SystemExit(128 + signum)`` for SIGTERM). A signal that is ignored when the
            emulator starts (nohup, background jobs) stays ignored. Main thread only; meant
            for CLIs.
        epoch: the scenario epoch whose rates are applied at start.
    """

    def __init__(
        self,
        scenario: Scenario | Sequence[float],
        *,
        subnet: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        reaper: bool = True,
        handle_signals: bool = False,
        epoch: int = 0,
    ) -> None:
        if not isinstance(scenario, Scenario):
            scenario = Scenario.static(list(scenario))
        if not prefix.isalpha() or not prefix.islower() or not prefix.isascii():
            raise ValueError(f"prefix must be lowercase ASCII letters, got {prefix!r}")
        self.scenario = scenario
        self.n = scenario.nodes
        self.prefix = prefix
        self.run_id = f"{prefix}{os.getpid()}-{secrets.token_hex(3)}"
        self.hub = f"{self.run_id}-hub"
        self.namespaces = [f"{self.run_id}-n{i}" for i in range(self.n)]
        self.epoch = epoch
        self._rates = [float(r) for r in scenario.rates_at(epoch)]
        self._subnet_arg = subnet
        self._subnet: ipaddress.IPv4Network | None = None
        self._want_reaper = reaper
        self._handle_signals = handle_signals
        self._lock = threading.RLock()
        self._state = "new"  # new -> starting -> up -> closed
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._reaper: subprocess.Popen[bytes] | None = None
        self._old_handlers: dict[int, Any] = {}
        self._driver: DynamicDriver | None = None
        self._ip = self._tc = ""

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Netem:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Netem:
        """Create namespaces, bridge, veths, addresses and qdiscs; undo all of it on error."""
        with self._lock:
            if self._state != "new":
                raise NetemError(f"Netem.start(): already {self._state}")
            self._ip, self._tc = require_root()
            self._state = "starting"
            atexit.register(self.close)
            try:
                if self._handle_signals:
                    self._install_signal_handlers()
                if self._want_reaper:
                    self._start_reaper()
                self._subnet = self._choose_subnet()
                self._build()
                self._set_tcp_cc()
                self._shape_all()
            except BaseException:
                self.close()
                raise
            self._state = "up"
            log.info(
                "netem: %d nodes up (run %s, subnet %s, rates %s Mbit/s)",
                self.n,
                self.run_id,
                self._subnet,
                ", ".join(f"{r:g}" for r in self._rates),
            )
            return self

    def close(self) -> None:
        """Stop the driver and node processes, remove every device and namespace. Idempotent."""
        drv = self._driver
        if drv is not None:
            drv.stop()  # outside the lock: the driver may be waiting for it in set_rates
        with self._lock:
            if self._state in ("new", "closed"):
                self._state = "closed"
                return
            self._state = "closed"
            atexit.unregister(self.close)
            clean = False
            try:
                self._stop_procs()
                names = sorted(set(self._created) | set(self._live_names()))
                if names:
                    reap.remove_run(self._ip, self.run_id, names=names)
                left = self._live_names()
                if left:
                    log.error("netem: could not remove %s", left)
                clean = not left
            finally:
                # Unless everything is gone, let the reaper make one more attempt.
                self._stop_reaper(clean)
                self._restore_signal_handlers()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._state == "closed"

    # -- queries -----------------------------------------------------------------------------

    @property
    def rates(self) -> list[float]:
        """Per-node rates (Mbit/s) currently applied."""
        return list(self._rates)

    @property
    def subnet(self) -> str:
        """The nodes' IPv4 subnet, e.g. ``10.77.0.0/24``."""
        self._require_up()
        return str(self._subnet)

    def node_ns(self, i: int) -> str:
        """Namespace name of node ``i``."""
        self._check_index(i)
        return self.namespaces[i]

    def node_ip(self, i: int) -> str:
        """IPv4 address of node ``i`` (``<subnet>.(i+1)``)."""
        self._check_index(i)
        self._require_up()
        assert self._subnet is not None
        return str(self._subnet.network_address + i + 1)

    def node_ips(self) -> list[str]:
        """Addresses of all nodes, by index."""
        return [self.node_ip(i) for i in range(self.n)]

    def node_env(self, i: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) plus ``HETPS_NETEM_NODE/IP/NODES/IPS`` for node ``i``."""
        env = dict(os.environ if base is None else base)
        env.update(
            HETPS_NETEM_NODE=str(i),
            HETPS_NETEM_IP=self.node_ip(i),
            HETPS_NETEM_NODES=str(self.n),
            HETPS_NETEM_IPS=",".join(self.node_ips()),
        )
        return env

    def exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``[ip, 'netns', 'exec', <ns of node i>, *argv]`` (``ip`` as an absolute path)."""
        self._require_up()
        return [self._ip, "netns", "exec", self.node_ns(i), *argv]

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside node ``i``'s namespace (``subprocess.Popen`` keywords apply).

        The process is tracked: :meth:`close` terminates it (SIGTERM, then SIGKILL) if it is
        still running.
        """
        p = subprocess.Popen(self.exec_argv(i, argv), **kw)
        with self._lock:
            self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` to completion inside node ``i``'s namespace (``subprocess.run``)."""
        return subprocess.run(self.exec_argv(i, argv), **kw)

    # -- live changes ------------------------------------------------------------------------

    def set_rates(self, rates_mbit: Sequence[float], *, epoch: int | None = None) -> None:
        """Re-shape every node to ``rates_mbit`` (one per node) in place (``tc class change``)."""
        rates = [float(r) for r in rates_mbit]
        if len(rates) != self.n or any(not r > 0 for r in rates):
            raise ValueError(f"set_rates: need {self.n} positive rates (Mbit/s), got {rates}")
        with self._lock:
            self._require_up()
            self._shape_all(rates, change=True)
            self._rates = rates
            if epoch is not None:
                self.epoch = epoch
        log.info("netem: rates now %s Mbit/s", ", ".join(f"{r:g}" for r in rates))

    def start_dynamic(
        self, on_change: Callable[[int, list[float]], None] | None = None
    ) -> DynamicDriver:
        """Start a :class:`DynamicDriver` for this emulator's scenario; stopped by close()."""
        with self._lock:
            self._require_up()
            if self._driver is not None:
                raise NetemError("start_dynamic(): a driver is already running")
            self._driver = DynamicDriver(self, on_change=on_change, start_epoch=self.epoch)
            return self._driver.start()

    def tc_stats(self, i: int, *, ingress: bool = False) -> str:
        """``tc -s qdisc show`` of node ``i``'s egress (or ingress) shaper, for debugging."""
        self._require_up()
        ns, dev = (self.hub, f"v{i}") if ingress else (self.node_ns(i), NODE_IF)
        return run_tool([self._tc, "-n", ns, "-s", "qdisc", "show", "dev", dev], what="tc show")

    # -- internals ---------------------------------------------------------------------------

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise IndexError(f"node index {i} out of range 0..{self.n - 1}")

    def _require_up(self) -> None:
        if self._state not in ("up", "starting"):
            raise NetemError(f"Netem is {self._state}; use it inside `with Netem(...)`")

    def _live_names(self) -> list[str]:
        if not self._ip:
            return []
        return [n for n in reap.list_namespaces(self._ip) if n.startswith(self.run_id + "-")]

    def _choose_subnet(self) -> ipaddress.IPv4Network:
        if self._subnet_arg is None:
            return pick_subnet(self._ip)
        net = ipaddress.IPv4Network(self._subnet_arg, strict=True)
        if net.num_addresses - 2 < self.n:
            raise NetemError(f"subnet {net} has room for {net.num_addresses - 2} < {self.n} nodes")
        return net

    def _netns_add(self, name: str) -> None:
        if self._state != "starting":  # e.g. a signal handler closed us during setup
            raise NetemError(f"Netem closed during setup (state {self._state})")
        self._created.append(name)  # before creating: a signal in between must still undo it
        run_tool([self._ip, "netns", "add", name], what=f"creating namespace {name}")

    def _build(self) -> None:
        assert self._subnet is not None
        self._netns_add(self.hub)
        hub_cmds = [
            f"link add {BRIDGE} type bridge stp_state 0",
            f"link set dev {BRIDGE} addrgenmode none",
            f"link set {BRIDGE} up",
            "link set lo up",
        ]
        self._batch(self._ip, self.hub, hub_cmds, "creating the bridge")
        plen = self._subnet.prefixlen
        for i, ns in enumerate(self.namespaces):
            self._netns_add(ns)
            hub_cmds = [
                f"link add v{i} type veth peer name {NODE_IF} netns {ns}",
                f"link set dev v{i} addrgenmode none",
                f"link set v{i} master {BRIDGE}",
                f"link set v{i} up",
            ]
            self._batch(self._ip, self.hub, hub_cmds, f"creating veth of node {i}")
            node_cmds = [
                "link set lo up",
                f"link set dev {NODE_IF} addrgenmode none",
                # one TCP segment per packet (no GSO super-packets): a packet queued in a TBF
                # is then never larger than a bucket, also after a rate cut shrinks the
                # bucket; a bigger one could never be sent and the link would stall until
                # the rate rose again (docs/NETEM.md, "Burst size")
                f"link set dev {NODE_IF} gso_max_segs 1",
                f"addr add {self.node_ip(i)}/{plen} dev {NODE_IF}",
                f"link set {NODE_IF} up",
            ]
            self._batch(self._ip, ns, node_cmds, f"configuring node {i}")

    @staticmethod
    def _batch(tool: str, ns: str, cmds: list[str], what: str) -> None:
        """Run ``cmds`` as one ``ip``/``tc`` batch inside namespace ``ns``."""
        run_tool([tool, "-n", ns, "-batch", "-"], input="\n".join(cmds) + "\n", what=what)

    def _set_tcp_cc(self) -> None:
        """Set the scenario's TCP congestion control inside every node's namespace."""
        cc = self.scenario.tcp_cc
        if not cc:
            return
        for i in range(self.n):
            argv = self.exec_argv(i, ["sh", "-c", f'echo "$1" > {TCP_CC_FILE}', "sh", cc])
            r = subprocess.run(argv, capture_output=True, text=True)
            if r.returncode != 0:
                allowed = read_sysctl("tcp_allowed_congestion_control")
                available = read_sysctl("tcp_available_congestion_control")
                raise NetemUnsupportedError(
                    f"tcp_cc = {cc!r}: node {i}'s namespace refused it "
                    f"({(r.stderr or r.stdout).strip()}); a namespace may only choose one of "
                    f"net.ipv4.tcp_allowed_congestion_control ({allowed}) among those the "
                    f"kernel has ({available}); fix: pick one of those (reno always works), "
                    "or add it to the allowed list on the host, or drop tcp_cc to keep the "
                    "host's default"
                )

    def _shape_all(self, rates: list[float] | None = None, *, change: bool = False) -> None:
        rates = self._rates if rates is None else rates
        pair = self.scenario.pair_rates_mbit
        delay = self.scenario.delay_ms
        hub_cmds: list[str] = []
        for i in range(self.n):
            node_cmds = self._egress_cmds(i, rates[i], pair[i] if pair else None, delay[i], change)
            self._batch(self._tc, self.node_ns(i), node_cmds, f"shaping node {i} egress")
            # node i's ingress: a TBF on the bridge-side veth v<i> (its egress toward node i)
            verb = "change" if change else "add"
            hub_cmds.append(
                f"qdisc {verb} dev v{i} root handle 1: tbf {tbf_params(bits(rates[i]))}"
            )
        self._batch(self._tc, self.hub, hub_cmds, "shaping ingress")

    def _egress_cmds(
        self, i: int, rate: float, pair_row: Sequence[float] | None, delay_ms: float, change: bool
    ) -> list[str]:
        """Node egress: root TBF at the node's rate; under it (pair rates) an HTB classifier
        with one TBF per destination; an optional netem delay under each leaf."""
        dev = NODE_IF
        tbf = tbf_params(bits(rate))
        if change:  # only the node's rate changes; the pair caps are static
            return [f"qdisc change dev {dev} root handle 1: tbf {tbf}"]
        cmds = [f"qdisc add dev {dev} root handle 1: tbf {tbf}"]
        netem = ""
        if delay_ms > 0:
            limit = max(1000, int(bits(rate) / 8 * delay_ms / 1000 / FRAME * 4))
            netem = f"netem delay {delay_ms:g}ms limit {limit}"
        if pair_row is None:
            if netem:
                cmds.append(f"qdisc add dev {dev} parent 1:1 handle 10: {netem}")
            return cmds
        cmds.append(f"qdisc add dev {dev} parent 1:1 handle 2: htb default 10")
        cmds.append(f"class add dev {dev} parent 2: classid 2:10 htb {CLASSIFY}")
        if netem:
            cmds.append(f"qdisc add dev {dev} parent 2:10 handle 10: {netem}")
        for j in range(self.n):
            if j == i:
                continue
            h = f"{0x100 + j:x}"
            cmds += [
                f"class add dev {dev} parent 2: classid 2:{h} htb {CLASSIFY}",
                f"qdisc add dev {dev} parent 2:{h} handle {h}: tbf {tbf_params(bits(pair_row[j]))}",
                f"filter add dev {dev} parent 2: protocol ip prio 1 u32 "
                f"match ip dst {self.node_ip(j)}/32 flowid 2:{h}",
            ]
            if netem:
                cmds.append(f"qdisc add dev {dev} parent {h}:1 handle {0x1000 + j:x}: {netem}")
        return cmds

    def _stop_procs(self) -> None:
        procs = [p for p in self._procs if p.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    log.error("netem: pid %d does not die", p.pid)

    def _start_reaper(self) -> None:
        self._reaper = subprocess.Popen(
            [sys.executable, "-I", reap.__file__, self._ip, self.run_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a signal to our process group must not kill it
            close_fds=True,
        )

    def _stop_reaper(self, clean: bool) -> None:
        rp, self._reaper = self._reaper, None
        if rp is None:
            return
        with contextlib.suppress(OSError):  # (a broken pipe: the reaper is gone)
            if clean:
                rp.stdin.write(b"done\n")
            rp.stdin.close()
        try:
            rp.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            rp.kill()
            rp.wait(timeout=5.0)

    @property
    def reaper_pid(self) -> int | None:
        """Pid of the guard process (``None`` without one)."""
        return self._reaper.pid if self._reaper is not None else None

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise NetemError("handle_signals=True needs the main thread")
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) == signal.SIG_IGN:
                continue  # ignored on purpose (nohup, a background job): leave it so
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        old, self._old_handlers = self._old_handlers, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in old.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        prev = self._old_handlers.get(signum, signal.SIG_DFL)
        log.warning("netem: signal %d, removing namespaces of run %s", signum, self.run_id)
        self.close()  # restores the previous handlers
        if callable(prev):
            prev(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def __repr__(self) -> str:
        return f"Netem(run_id={self.run_id!r}, nodes={self.n}, state={self._state!r})"
