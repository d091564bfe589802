"""Bad input, dead peers, unreachable schedulers: clear errors, nobody hangs, nothing lost."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hetps.cluster.errors import ClusterError
from hetps.config import ConfigError
from roles import role_env


def test_bad_push_is_refused_and_server_keeps_serving(cluster):
    code = """
import zmq, msgpack
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros((4, 5), np.float32))
# wrong shape and dtype: refused on the caller, with both shapes named
for bad in (np.zeros((5, 4), np.float32), np.zeros((4, 5), np.float64)):
    try:
        kv.push('w', bad)
        raise SystemExit('bad push accepted')
    except ValueError as e:
        assert "(5, 4)" in str(e) or "float64" in str(e), e
        assert "(4, 5)" in str(e), e
try:
    kv.pull('nokey')
    raise SystemExit('pull of an uninitialised key accepted')
except KeyError as e:
    assert 'never initialised' in str(e), e
# the same mistakes sent raw to the server (bypassing the client's checks) are refused there
from hetps.transport.codec import Message
sid = kv.server_ids[0]
fut = kv.node.request(sid, Message('push', body={'k': 'w', 'part': 0, 'off': 0, 'n': 30,
                                                 'sync': True}, arrays=[np.zeros(30, np.float32)]))
try:
    fut.wait(10); raise SystemExit('server accepted an out-of-range push')
except RequestError as e:
    assert "'w'" in str(e) and 'outside' in str(e), e
fut = kv.node.request(sid, Message('pull', body={'k': 'ghost', 'part': 0, 'off': 0, 'n': 1}))
try:
    fut.wait(10); raise SystemExit('server served a key never initialised')
except RequestError as e:
    assert 'never initialised' in str(e), e
# garbage frames straight to the server's socket: dropped and logged, never fatal
ctx = zmq.Context.instance()
s = ctx.socket(zmq.DEALER)
if kv.node.van.keys is not None:  # a peer with the job's secret: past the handshake
    kv.node.van.keys.client(s)
info = kv.node.nodes[sid]
s.connect(f"tcp://{info.host}:{info.port}")
s.send_multipart([b'not msgpack'])
s.send_multipart([msgpack.packb({'v': 1, 'c': 'push', 's': 9, 'r': 1, 'p': False, 'b': {},
                                 'a': [['float32', [1000]]]}), b'short'])
s.send_multipart([msgpack.packb({'v': 99})])
s.close(linger=1000)
# and the server still serves everyone correctly
kv.push('w', np.ones((4, 5), np.float32))
assert (kv.pull('w') == kv.num_workers).all()
kv.barrier()
print('BAD-OK', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("BAD-OK") == 2, out
    assert "dropped a bad message" in out


def test_a_hung_worker_is_found_by_heartbeats(cluster):
    """A worker that hangs (SIGSTOP: alive, so the launcher sees nothing) is found by the
    heartbeats, and the others get a clear error naming it."""
    code = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(100, np.float32))
if kv.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
t0 = time.time()
try:
    kv.push('w', np.ones(100, np.float32))      # returns at once (MXNet's push) ...
    kv.pull('w')                                # ... the pull waits for rank 1, which is dead
    raise SystemExit('push completed without the dead worker')
except NodeFailure as e:
    print(f'GOT-FAILURE after {time.time() - t0:.1f}s: {e}', flush=True)
    assert 'worker rank 1' in str(e) and '127.0.0.1:' in str(e), e
    os._exit(0)
"""
    t0 = time.monotonic()
    rc, out = cluster(
        code,
        workers=2,
        servers=1,
        env={"PS_HEARTBEAT_INTERVAL": "0.3", "PS_HEARTBEAT_TIMEOUT": "2"},
    )
    elapsed = time.monotonic() - t0
    assert "GOT-FAILURE" in out, out
    assert "stopped answering heartbeats" in out, out
    assert rc != 0  # the launcher reports the dead worker's exit
    assert elapsed < 30, elapsed


def test_crashing_worker_is_reported_at_once(cluster):
    code = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(10, np.float32))
if kv.rank == 1:
    raise RuntimeError('boom in user code')
try:
    kv.push('w', np.ones(10, np.float32))
    kv.pull('w')
except NodeFailure as e:
    assert 'boom in user code' in str(e) and 'worker rank 1' in str(e), e
    print('SAW-CRASH', flush=True)
    os._exit(0)
"""
    rc, out = cluster(code, workers=2, servers=1, env={"PS_HEARTBEAT_TIMEOUT": "60"})
    assert "SAW-CRASH" in out, out
    assert rc == 1


def test_unreachable_scheduler_times_out(tmp_path):
    from hetps.kv import create

    env = {
        "DMLC_ROLE": "worker",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "1",  # privileged port: nothing of ours listens there
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "1",
        "HETPS_CONNECT_TIMEOUT": "1.5",
    }
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match="could not reach the scheduler at 127.0.0.1:1"):
        create("dist_sync", env=env)
    assert time.monotonic() - t0 < 10


def test_a_hetps_command_reports_an_unreachable_scheduler_in_one_line():
    """`hetps train` as a worker, with no scheduler: one line naming the cause and the fix,
    exit code 1, no traceback."""
    env = role_env("worker", 1, clean=True, HETPS_CONNECT_TIMEOUT=1.5)
    res = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "train", "-m", "sync", "-n", "mlp"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("hetps train: could not reach the scheduler at 127.0.0.1:1"), lines
    assert "DMLC_PS_ROOT_PORT" in lines[-1], lines


@pytest.mark.parametrize(
    "env,names",
    [
        ({}, ["DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER"]),
        (
            {
                "DMLC_ROLE": "worker",
                "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": "x",
                "DMLC_NUM_SERVER": "0",
                "DMLC_NUM_WORKER": "2",
            },
            ["DMLC_PS_ROOT_PORT='x'", "DMLC_NUM_SERVER=0"],
        ),
        ({"DMLC_ROLE": "boss"}, ["DMLC_ROLE='boss'"]),
    ],
)
def test_create_names_missing_or_malformed_variables(env, names):
    from hetps.kv import create

    with pytest.raises(ConfigError) as info:
        create("dist_sync", env=env)
    for n in names:
        assert n in str(info.value)


def test_scheduler_death_is_detected(tmp_path):
    """A worker whose scheduler vanishes gets a clear error within the heartbeat timeout."""
    port_file = tmp_path / "port"
    env = role_env("scheduler")
    sched = subprocess.Popen(
        [sys.executable, "-m", "hetps.cli", "scheduler"],
        env=env,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    server = None
    try:
        line = sched.stdout.readline().decode()
        port = line.split()[-1]
        env.update(DMLC_PS_ROOT_PORT=port, PS_HEARTBEAT_INTERVAL="0.3", PS_HEARTBEAT_TIMEOUT="2")
        server = subprocess.Popen(
            [sys.executable, "-m", "hetps.cli", "server"],
            env={**env, "DMLC_ROLE": "server"},
            start_new_session=True,
            stderr=subprocess.PIPE,
        )
        from hetps.kv import create

        kv = create("dist_sync", env={**env, "DMLC_ROLE": "worker"})
        kv.init(0, __import__("numpy").zeros(3, "float32"))
        sched.kill()
        sched.wait()
        from hetps.cluster.errors import NodeFailure

        deadline = time.monotonic() + 15
        with pytest.raises(NodeFailure, match="scheduler"):
            while time.monotonic() < deadline:
                kv.node.exited.wait(0.5)
                kv.pull(0)
        kv.close()
        assert server.wait(timeout=15) == 1
        assert b"scheduler" in server.stderr.read()
    finally:
        for p in (sched, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    del port_file


def test_uneven_batch_counts_error_instead_of_hang(cluster):
    code = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(10, np.float32))
rounds = 2 if kv.rank == 0 else 3          # rank 1 runs one round more than rank 0
try:
    for _ in range(rounds):
        kv.push('w', np.ones(10, np.float32))
        kv.pull('w')
    print('DONE', kv.rank, flush=True)
except RequestError as e:
    assert 'worker rank 0' in str(e) and 'same number of rounds' in str(e), e
    print('UNEVEN-DETECTED', flush=True)
"""
    rc, out = cluster(code, workers=2, servers=1, env={"PS_HEARTBEAT_TIMEOUT": "60"})
    assert rc == 0, out
    assert "DONE 0" in out and "UNEVEN-DETECTED" in out, out


def test_the_launcher_tells_the_scheduler_of_a_death_at_once(cluster):
    """A worker killed by SIGKILL: the launcher tells the scheduler at once, which declares it
    dead with the launcher's cause, so the survivor fails with that cause (long before the
    60 s heartbeat timeout and the launcher's 30 s grace)."""
    code = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(4, np.float32))
kv.barrier()
if kv.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    kv.barrier()
except ClusterError as exc:
    print(f'SURVIVOR {exc}', flush=True)
    sys.exit(5)
"""
    rc, out = cluster(
        code, workers=2, servers=1, env={"PS_HEARTBEAT_TIMEOUT": "60"}, failure_grace=30.0
    )
    assert rc == 137, out
    (line,) = [x for x in out.splitlines() if "SURVIVOR" in x]
    assert "worker rank 1" in line, out
    assert "was killed by signal 9 (code 137) (seen by the launcher)" in line, out


def test_a_node_that_dies_before_registering_fails_the_start_at_once(cluster):
    """Worker 1 exits before it joins: the others are told at once (not after the 20 s
    registration timeout) and end with the launcher's cause."""
    code = """
if os.environ['HETPS_LAUNCH_RANK'] == '1':
    sys.exit(4)
try:
    kv = hetps.kv.create('dist_sync')
except ClusterError as exc:
    print(f'REFUSED {exc}', flush=True)
    sys.exit(6)
"""
    rc, out = cluster(
        code,
        workers=2,
        servers=1,
        env={"PS_HEARTBEAT_TIMEOUT": "60", "HETPS_CONNECT_TIMEOUT": "60"},
        failure_grace=30.0,
    )
    assert rc == 4, out
    (line,) = [x for x in out.splitlines() if "REFUSED" in x]
    assert "worker 1 exited (code 4) before it registered (seen by the launcher)" in line, out
    assert "[launcher] stopping" not in out, out  # every survivor was told, and ended itself
    assert "[scheduler]" in out and "before it registered" in out.split("[scheduler]", 1)[1], out


def test_a_long_handler_does_not_make_the_scheduler_look_dead(cluster):
    """A server optimizer that takes twice the heartbeat timeout holds the server's receive
    thread, so the scheduler's heartbeat answers wait unread meanwhile: that silence is the
    server's own, and nobody is declared dead."""
    code = """
class Slow(optim.Optimizer):
    def create_state(self, key, weight):
        return None
    def update(self, key, weight, grad, state):
        time.sleep(3.0)  # the work itself: twice PS_HEARTBEAT_TIMEOUT
        weight -= self.learning_rate * grad

kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(4, np.float32))
kv.set_optimizer(Slow(learning_rate=1.0))
kv.push('w', np.ones(4, np.float32))
assert (kv.pull('w') == -kv.num_workers).all(), kv.pull('w')
kv.barrier()
print('SLOW-OK', flush=True)
"""
    rc, out = cluster(
        code,
        workers=1,
        servers=1,
        env={
            "PS_HEARTBEAT_INTERVAL": "0.2",
            "PS_HEARTBEAT_TIMEOUT": "1.5",
            "HETPS_OPTIMIZERS": "any",  # Slow is a class of the worker's script
        },
    )
    assert rc == 0, out
    assert "SLOW-OK" in out and "stopped answering" not in out, out
