"""The cluster secret: where it comes from, where it never goes, and what happens without it.

Real processes: ``hetps scheduler`` refusing a routable address without a secret (no traffic
needed) and starting with ``HETPS_INSECURE=1``; MXNet-style roles started by hand with
``HETPS_SECRET_FILE`` (and one without it, refused at the handshake with an error that says
so); ``hetps launch`` locally and over (a stand-in) ssh, with no command line of any process
holding the secret.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hetps.config import ConfigError, node_config_from_env, security_from_env

from .lines import Lines as _Lines

ROUTABLE = "10.255.255.1"  # not loopback; never contacted (the scheduler refuses first)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HETPS_", "DMLC_", "PS_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def test_a_routable_scheduler_without_a_secret_refuses_to_start_and_insecure_warns():
    env = _clean_env(
        DMLC_ROLE="scheduler",
        DMLC_PS_ROOT_URI=ROUTABLE,
        DMLC_NODE_HOST=ROUTABLE,
        DMLC_PS_ROOT_PORT="0",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="1",
    )
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "without a cluster secret" in res.stderr and ROUTABLE in res.stderr
    assert "HETPS_SECRET_FILE" in res.stderr and "HETPS_INSECURE=1" in res.stderr
    assert "hetps scheduler port" not in res.stdout  # it never listened
    # the explicit opt-out starts it, with a warning
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env={**env, "HETPS_INSECURE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = _Lines(proc.stdout)
        lines.wait(r"HETPS_INSECURE=1: no cluster secret; it listens on every interface")
        lines.wait(r"hetps scheduler port \d+")
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_every_role_needs_the_secret_across_hosts():
    base = {
        "DMLC_ROLE": "worker",
        "DMLC_PS_ROOT_URI": ROUTABLE,
        "DMLC_NODE_HOST": "10.255.255.2",
        "DMLC_PS_ROOT_PORT": "9000",
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "1",
    }
    with pytest.raises(ConfigError, match="HETPS_SECRET_FILE.*HETPS_INSECURE=1"):
        node_config_from_env(base)
    assert node_config_from_env({**base, "HETPS_INSECURE": "1"}).insecure
    cfg = node_config_from_env({**base, "HETPS_SECRET": "s" * 64})
    assert cfg.secret == b"s" * 64 and "s" * 64 not in repr(cfg)  # never in a repr or a log
    # on loopback, MXNet-style roles need nothing
    loop = {**base, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NODE_HOST": "127.0.0.1"}
    assert node_config_from_env(loop).secret is None


def test_hetps_secret_writes_a_private_file_and_the_variables_are_checked(tmp_path):
    path = tmp_path / "job.secret"
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "secret", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert os.stat(path).st_mode & 0o777 == 0o600
    secret = path.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert f"HETPS_SECRET_FILE={path}" in res.stderr
    again = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "secret", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 1 and "never overwritten" in again.stderr
    assert path.read_text().strip() == secret
    assert security_from_env({"HETPS_SECRET_FILE": str(path)}) == (secret.encode(), False)
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match=r"open to others \(mode 0640.*chmod 600"):
        security_from_env({"HETPS_SECRET_FILE": str(path)})
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="cannot open it"):
        security_from_env({"HETPS_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="both set: set only one"):
        security_from_env({"HETPS_SECRET_FILE": str(path), "HETPS_SECRET": secret})
    with pytest.raises(ConfigError, match="at least 32"):
        security_from_env({"HETPS_SECRET": "short"})
    with pytest.raises(ConfigError, match="HETPS_INSECURE=1 and a cluster secret"):
        security_from_env({"HETPS_SECRET": secret, "HETPS_INSECURE": "1"})


TRAIN = """
import numpy as np
import hetps.kv
kv = hetps.kv.create('dist_sync')     # servers and the scheduler never return from here
kv.init(0, np.zeros(3, np.float32))
kv.push(0, np.ones(3, np.float32))
print('WORKER', kv.rank, kv.pull(0).tolist(), flush=True)
"""


def test_roles_by_hand_with_a_secret_file_and_one_without_it(tmp_path):
    """MXNet's way (DMLC_ROLE=... python train.py), secured by one extra variable; a worker
    without the secret is refused at the handshake and says why at once."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    secret = tmp_path / "job.secret"
    subprocess.run([sys.executable, "-m", "hetps.cli", "secret", str(secret)], check=True)
    base = _clean_env(
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="2",
        HETPS_SECRET_FILE=str(secret),
    )
    procs: list[subprocess.Popen] = []
    try:
        sched = subprocess.Popen(
            [sys.executable, str(script)],
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**base, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "0", "PS_VERBOSE": "1"},
        )
        procs.append(sched)
        lines = _Lines(sched.stdout)
        port = lines.wait(r"scheduler listening on 127\.0\.0\.1:(\d+)").group(1)
        # a worker of another job (no secret) knocks first: refused at once, and it says why
        t0 = time.monotonic()
        stranger = subprocess.run(
            [sys.executable, str(script)],
            env={
                **{k: v for k, v in base.items() if k != "HETPS_SECRET_FILE"},
                "DMLC_ROLE": "worker",
                "DMLC_PS_ROOT_PORT": port,
                "HETPS_CONNECT_TIMEOUT": "30",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stranger.returncode != 0
        assert time.monotonic() - t0 < 20  # not the 30 s connect timeout
        assert "refused the connection" in stranger.stderr, stderr_tail(stranger.stderr)
        assert "HETPS_SECRET_FILE" in stranger.stderr
        for role in ("server", "worker", "worker"):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    start_new_session=True,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**base, "DMLC_ROLE": role, "DMLC_PS_ROOT_PORT": port},
                )
            )
        outs = [p.communicate(timeout=60)[0] for p in procs[1:]]
        assert sched.wait(timeout=30) == 0
        lines.t.join(10)
        sched_out = "".join(lines.lines)
        assert [p.returncode for p in procs] == [0, 0, 0, 0], sched_out
        assert "".join(o for o in outs if o).count("[2.0, 2.0, 2.0]") == 2
        assert "plain mode" not in sched_out  # it ran secured
        assert "refused a connection" in sched_out  # the stranger, logged by the scheduler
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def stderr_tail(text: str) -> str:
    return text[-2000:]


WHO_HOLDS_IT = """
import hashlib, os
import numpy as np
import hetps.kv
kv = hetps.kv.create('dist_sync')
secret = os.environ['HETPS_SECRET']
on_a_command_line = []
for pid in os.listdir('/proc'):
    if pid.isdigit():
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if secret.encode() in f.read():
                    on_a_command_line.append(pid)
        except OSError:
            pass
kv.init('k', np.ones(2, np.float32))
kv.barrier()
print('SECRET', hashlib.sha256(secret.encode()).hexdigest(), 'ARGV', on_a_command_line,
      flush=True)
"""


@pytest.mark.parametrize("launcher", ["local", "ssh"])
def test_launch_makes_a_secret_per_job_and_no_command_line_holds_it(tmp_path, launcher):
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(WHO_HOLDS_IT))
    argv = [sys.executable, "-m", "hetps.cli", "launch", "-n", "2", "-s", "1"]
    env = _clean_env()
    log = tmp_path / "ssh.log"
    if launcher == "ssh":
        fake = tmp_path / "fake-ssh"  # logs every argument, runs the remote line here
        fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {log}\nexec sh -c "$6"\n')
        fake.chmod(0o755)
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1\n")
        argv += ["--launcher", "ssh", "-H", str(hosts)]
        env["HETPS_SSH"] = str(fake)
    hashes = []
    for _ in range(2):  # two jobs: two secrets
        res = subprocess.run(
            [*argv, "--", sys.executable, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        found = re.findall(r"SECRET ([0-9a-f]{64}) ARGV \[\]", res.stdout)
        assert len(found) == 2 and found[0] == found[1], res.stdout  # shared, on no argv
        assert "plain mode" not in res.stdout  # the job ran secured
        hashes.append(found[0])
    assert hashes[0] != hashes[1]  # a fresh secret for each job
    if launcher == "ssh":
        logged = log.read_text()
        assert "IFS= read -r HETPS_SECRET" in logged and "HETPS_SECRET=" not in logged


def test_launch_refuses_a_secret_on_its_own_command_line():
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "--env", "HETPS_SECRET=x", "--"]
        + ["true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "HETPS_SECRET_FILE" in res.stderr


def test_the_secret_never_shows_in_a_config_repr():
    cfg = node_config_from_env(
        {
            "DMLC_ROLE": "worker",
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": "1",
            "DMLC_NUM_SERVER": "1",
            "DMLC_NUM_WORKER": "1",
            "HETPS_SECRET": "x" * 40,
        }
    )
    assert "x" * 40 not in repr(cfg) and cfg.secret == b"x" * 40
    assert hashlib.sha256(cfg.secret).hexdigest()  # bytes, ready for the key derivation


__all__ = ["Path"]


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_an_empty_or_blank_secret_file_is_refused_not_plain_mode(tmp_path, content):
    path = tmp_path / "job.secret"
    path.write_text(content)
    path.chmod(0o600)
    env = _clean_env(
        DMLC_ROLE="scheduler",
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT="0",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="1",
        HETPS_SECRET_FILE=str(path),
    )
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"HETPS_SECRET_FILE={path} is empty" in res.stderr, res.stderr
    assert "hetps secret FILE" in res.stderr
    assert "plain mode" not in res.stdout + res.stderr
    # a variable set but blank names no file: refused the same way
    blank = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env={**env, "HETPS_SECRET_FILE": " "},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert blank.returncode == 2 and "HETPS_SECRET_FILE is set but names no file" in blank.stderr
    with pytest.raises(ConfigError, match="HETPS_SECRET is set but holds no secret"):
        security_from_env({"HETPS_SECRET": "  "})


def test_a_secret_file_of_another_user_says_so_not_chmod(tmp_path):
    path = tmp_path / "job.secret"
    path.write_text("s" * 64)
    path.chmod(0o600)
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)  # nobody's
    else:
        path = Path("/etc/passwd")  # root's
    with pytest.raises(ConfigError) as err:
        security_from_env({"HETPS_SECRET_FILE": str(path)})
    text = str(err.value)
    assert (
        f"HETPS_SECRET_FILE={path} belongs to uid" in text
        and "chmod 600" not in text.split("(copy it")[0]
    )
    assert "copy it" in text


def _job_public_key(secret: str) -> bytes:
    from hetps.transport.security import Keys

    return Keys(secret.encode()).public_key


FORGER_WITH_THE_PUBLIC_KEY = """
import sys, zmq
from zmq.utils import z85
server_key, port = sys.argv[1].encode(), sys.argv[2]
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
pub, sec = zmq.curve_keypair()       # its own keys: it does not hold the job's secret
s.setsockopt(zmq.CURVE_SERVERKEY, server_key)
s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
s.setsockopt(zmq.CURVE_SECRETKEY, sec)
s.setsockopt(zmq.LINGER, 2000)
s.setsockopt(zmq.SNDTIMEO, 2000)  # (refused before it sends: no connection is left to queue on)
s.connect(f"tcp://127.0.0.1:{port}")
import msgpack
head = msgpack.packb({"v": 1, "c": "heartbeat", "r": 7, "p": False, "b": {}, "a": []})
try:
    s.send_multipart([head])
except zmq.Again:
    pass
s.close()
ctx.term()
"""


def test_zap_refuses_a_peer_that_knows_the_public_key_but_not_the_secret(tmp_path):
    """The job's CURVE public key is not secret: a peer that has it passes CURVE's HELLO and
    only the ZAP handler's key check stands between it and the scheduler. It is refused there,
    and nothing it sent reaches the scheduler."""
    secret = "k" * 64
    env = _clean_env(
        DMLC_ROLE="scheduler",
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT="0",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="1",
        HETPS_SECRET=secret,
        PS_VERBOSE="1",
    )
    sched = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = _Lines(sched.stdout)
        port = lines.wait(r"hetps scheduler port (\d+)").group(1)
        forger = tmp_path / "forger.py"
        forger.write_text(textwrap.dedent(FORGER_WITH_THE_PUBLIC_KEY))
        key = _job_public_key(secret).decode()
        subprocess.run([sys.executable, str(forger), key, port], check=True, timeout=60)
        lines.wait(r"refused a connection from .*: it does not hold this job's cluster secret")
        # a message that got through would be refused by identity and logged: a marker
        # message from a real client of the job, after the forger's, proves the log caught up
        import zmq

        from hetps.transport.security import Keys

        ctx = zmq.Context()
        ok = ctx.socket(zmq.DEALER)
        Keys(secret.encode()).client(ok)
        ok.setsockopt(zmq.LINGER, 2000)
        ok.connect(f"tcp://127.0.0.1:{port}")
        import msgpack

        ok.send_multipart([msgpack.packb({"v": 1, "c": "barrier", "r": 3, "p": False})])
        ok.close()
        ctx.term()
        lines.wait(r"refused barrier from a connection of no node")
        assert not any("refused heartbeat" in line for line in lines.lines), "".join(lines.lines)
    finally:
        os.killpg(sched.pid, 9)
        sched.wait()


def test_loopback_is_decided_by_the_resolved_address_not_the_spelling():
    from hetps.config import is_loopback
    from hetps.transport.van import is_local_host

    assert is_loopback("127.0.0.9") and is_loopback("::1") and is_loopback("localhost")
    # a name that merely starts with "127." is whatever it resolves to (here: nothing)
    spoof = "127.0.0.1.hetps-test.invalid"
    assert not is_loopback(spoof) and not is_local_host(spoof, "10.0.0.1")
    env = _clean_env(
        DMLC_ROLE="scheduler",
        DMLC_PS_ROOT_URI=spoof,
        DMLC_PS_ROOT_PORT="0",
        DMLC_NUM_SERVER="1",
        DMLC_NUM_WORKER="1",
    )
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # refused as a routable address without a secret, never plain mode
    assert res.returncode == 2, res.stdout + res.stderr
    assert "without a cluster secret" in res.stderr and spoof in res.stderr
