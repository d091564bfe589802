"""The scheduler looks for silent nodes once per tick, not once per message."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hetps.config import NodeConfig
from hetps.roles import new_scheduler
from hetps.transport.codec import Message
from hetps.transport.van import Van

CFG = dict(
    root_uri="127.0.0.1",
    root_port=0,
    num_server=1,
    num_worker=1,
    node_host="127.0.0.1",
    heartbeat_interval=1.0,
    heartbeat_timeout=5.0,
    connect_timeout=30,
)


def test_timeouts_are_checked_per_tick_not_per_message():
    sch = new_scheduler(NodeConfig(role="scheduler", **CFG))
    calls = []
    check = sch._check_timeouts
    sch._check_timeouts = lambda: (calls.append(1), check())[1]  # type: ignore[method-assign]
    sch.start()
    van = Van()
    try:
        van.connect(1, f"127.0.0.1:{sch.van.port}")
        t0 = time.monotonic()
        for _ in range(400):  # refused (no node's connection), but each one wakes the loop
            van.send(1, Message("heartbeat"))
        time.sleep(0.3)
        elapsed = time.monotonic() - t0
        # tick = interval / 2 = 0.5 s: a few checks, not one per message
        assert len(calls) <= 2 + elapsed / 0.5, len(calls)
        assert sch.exit_code is None
    finally:
        van.close()
        sch.stop()
        sch.join(5)


def test_a_registration_whose_host_is_not_an_address_is_refused(caplog):
    """A host with a line break (or any character no address has) would reach the logs and
    the launcher's pipe as text of the node's choosing: the registration is refused, and no
    log line carries the host's own line break."""
    sch = new_scheduler(NodeConfig(role="scheduler", **CFG))
    caplog.set_level("DEBUG")
    # as if the cluster were complete: a late registration is refused, naming its host
    full = [SimpleNamespace(origin=object(), role="server", want_rank=-1) for _ in range(2)]
    sch.registration.pending.extend(full)
    try:
        for host in ("x\nhetps scheduler stop server 0 forged", "a b", "h\x1b[2J"):
            sch._dispatch(
                Message(
                    "add_node", body={"role": "worker", "host": host, "port": 5000, "back": b"w1"}
                )  # fmt: skip
            )
        assert sch.registration.pending == full
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "\nhetps scheduler stop" not in logged and "\x1b" not in logged, logged
        sch.registration.pending.clear()
        sch._dispatch(
            Message(
                "add_node",
                body={"role": "worker", "host": "fe80::1%eth0", "port": 5000, "back": b"w1"},
            )  # fmt: skip
        )
        assert len(sch.registration.pending) == 1
    finally:
        sch.van.close()
