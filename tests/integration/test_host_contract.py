"""The host contract: every worker that `hetps launch` starts (locally, over ssh with a
hostfile) gets torchrun's variables and its host group, its registration carries the group to
the scheduler's node table, and servers and the scheduler get none of it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from hetps.launch.contract import places_per_node
from hetps.launch.wrappers import worker_hosts

HOST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
ALL_VARS = (*HOST_VARS, "HETPS_HOST_GROUP", "MASTER_ADDR", "MASTER_PORT")

#: every worker: its variables, the host groups of the scheduler's node table, and what the
#: job's servers and scheduler were given of the same variables (read from /proc: they run
#: on this machine, over the stand-in ssh too)
PROBE = textwrap.dedent(f"""
    import os
    import hetps.kv
    kv = hetps.kv.create('dist_sync')
    kv.barrier()
    names = {ALL_VARS!r}
    mine = ' '.join(os.environ.get(k, '-') for k in names)
    table = ','.join(str(n.group) for n in kv.node.workers())
    # (a worker's table gives the other workers no address: it never connects to them)
    addressed = [n.rank for n in kv.node.workers() if n.host]
    print('HOSTVARS', kv.rank, mine, 'table', table, 'host', os.environ['DMLC_NODE_HOST'],
          'addressed', addressed, flush=True)
    me = os.environ['HETPS_SECRET']
    for pid in os.listdir('/proc'):
        try:
            raw = open(f'/proc/{{pid}}/environ', 'rb').read()
        except OSError:
            continue
        env = dict(i.decode().split('=', 1) for i in raw.split(b'\\0') if b'=' in i)
        if env.get('HETPS_SECRET') == me and env.get('DMLC_ROLE') in ('server', 'scheduler'):
            print('OTHER', env['DMLC_ROLE'], [k for k in names if k in env], flush=True)
    kv.barrier()
""")


def _launch(args: list[str], tmp_path, **extra: str) -> str:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    # a launcher that itself runs under torchrun (or an older job's shell) passes stale
    # values: no role may keep them
    env = {**os.environ, "RANK": "99", "LOCAL_RANK": "7", "GROUP_RANK": "5", **extra}
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", *args, "--", sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _check(
    out: str, groups: list[int], hosts: list[str] | None = None, grouped: bool = True
) -> None:
    """Each worker's variables follow ``groups`` (its host by rank); ``grouped``: they are
    hetps's host groups too (else HETPS_HOST_GROUP is -1: each worker a host of its own)."""
    seen = re.findall(r"HOSTVARS (\d+) (.*) table (\S+) host (\S+) addressed \[(\d+)\]$", out, re.M)
    assert len(seen) == len(groups), out
    world = len(groups)
    for rank_s, values, table, host, addressed in seen:
        r = int(rank_s)
        assert addressed == rank_s, out  # its own entry only: the workers' made from counts
        rank, ws, local, lsize, group, hgroup, master_addr, master_port = values.split()
        mates = [i for i, g in enumerate(groups) if g == groups[r]]
        assert (rank, ws) == (str(r), str(world)), out
        assert (group, hgroup) == (str(groups[r]), str(groups[r] if grouped else -1)), out
        assert (local, lsize) == (str(mates.index(r)), str(len(mates))), out
        assert (master_addr, master_port) == ("-", "-"), out  # no c10d rendezvous here
        # the registration carried every worker's group to the scheduler, whose table says it
        assert table == ",".join(str(g if grouped else -1) for g in groups), out
        if hosts is not None:
            assert host == hosts[r], out
    others = re.findall(r"OTHER (\w+) (\[.*\])$", out, re.M)
    assert {role for role, _ in others} == {"server", "scheduler"}, out
    assert all(found == "[]" for _, found in others), out


@pytest.mark.parametrize(
    ("flags", "groups", "grouped"),
    [
        (["-n", "4", "-s", "1", "--nproc-per-node", "2"], [0, 0, 1, 1], True),
        # the default: torchrun's variables say the one machine (LOCAL_RANK 0..2), but no
        # host group (each worker plans and pushes alone, as without hosts)
        (["-n", "3", "-s", "1"], [0, 0, 0], False),
    ],
)
def test_local_workers_get_their_host(tmp_path, flags, groups, grouped):
    _check(_launch(flags, tmp_path), groups, grouped=grouped)


def test_ssh_hostfile_slots_place_workers_and_name_their_host(tmp_path):
    """--launcher ssh with a stand-in ssh that runs the remote command here: the hostfile's
    slots put two workers on the first host and one on the second (127.0.0.2: loopback too)."""
    fake = tmp_path / "fake-ssh"
    # (as sshd does, the remote command starts from a clean environment: what it exports)
    fake.write_text(
        '#!/bin/sh\n# args: -o X -o Y HOST COMMAND\nexec env -i PATH="$PATH" sh -c "$6"\n'
    )
    fake.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=2  # runs the scheduler too\n127.0.0.2 slots=2\n")
    out = _launch(
        ["-n", "3", "-s", "1", "--launcher", "ssh", "-H", str(hosts)],
        tmp_path,
        HETPS_SSH=str(fake),
    )
    _check(out, [0, 0, 1], hosts=["127.0.0.1", "127.0.0.1", "127.0.0.2"])


def test_placement_rules():
    assert [p.group for p in places_per_node(5, 2)] == [0, 0, 1, 1, 2]
    assert [p.local_size for p in places_per_node(5, 2)] == [2, 2, 2, 2, 1]
    hosts = [("a", 2), ("b", 1)]
    assert worker_hosts(hosts, 3) == ["a", "a", "b"]  # slots, in hostfile order
    assert worker_hosts([("a", None), ("b", None)], 3) == ["a", "b", "a"]  # round-robin
    assert worker_hosts(hosts, 3, per_node=2) == ["a", "a", "b"]
    with pytest.raises(SystemExit, match="slots hold 3"):
        worker_hosts(hosts, 4)
    with pytest.raises(SystemExit, match="need 3 hosts"):
        worker_hosts(hosts, 5, per_node=2)
