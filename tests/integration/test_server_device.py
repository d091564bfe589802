"""Servers that sum and update on a device (HETPS_SERVER_DEVICE) through a real cluster:
2 workers, 1 server, dist_sync, a key cut in chunks; each worker recomputes every round with
the NumPy optimizer and gets the server's weights (SGD bit for bit), the optimizer states a
worker reads back, and a server that cannot use its device says so at its start. On torch's
CPU device (``torch:cpu``: the device code, no GPU needed), and on CUDA where there is one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

CODE = """
opt_name = os.environ['OPT']
kv = hetps.kv.create('dist_sync')
r, W = kv.rank, kv.num_workers
n = 5000                                  # 5 chunks of 1024 values (HETPS_CHUNK_BYTES)
w0 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
kv.init('w', w0)
if opt_name == 'sgd':
    opt = optim.SGD(learning_rate=0.05, momentum=0.9, wd=1e-3, clip_gradient=0.5,
                    rescale_grad=1.0 / W)
else:
    opt = optim.Adam(learning_rate=0.01, wd=1e-4, clip_gradient=2.0, rescale_grad=1.0 / W)
kv.set_optimizer(opt)
ref, state = w0.copy(), opt.create_state(('w', 0), w0)
for rnd in range(5):
    gs = [np.random.default_rng(100 * rnd + k).standard_normal(n).astype(np.float32)
          for k in range(W)]
    kv.push('w', gs[r])
    got = kv.pull('w')
    again = kv.pull('w')                  # a second pull of the round: the same value
    opt.update(('w', 0), ref, gs[0] + gs[1], state)   # (2 workers: a+b == b+a)
    assert got.tobytes() == again.tobytes(), rnd
    if opt_name == 'sgd':
        assert got.tobytes() == ref.tobytes(), ('round', rnd, np.abs(got - ref).max())
    else:
        assert np.allclose(got, ref, rtol=1e-5, atol=1e-6), ('round', rnd, np.abs(got - ref).max())
    if rnd == 2 and r == 0:               # the states come back as NumPy, and go in again
        path = os.path.join(os.environ['OUT'], 'states')
        kv.save_optimizer_states(path)
        with open(path, 'rb') as f:
            saved = optim.load_states(f.read())
        (skey, st), = saved.items()
        for name, arr in st.items():
            if isinstance(arr, np.ndarray):
                assert isinstance(arr, np.ndarray) and np.allclose(arr, state[name], rtol=1e-5, atol=1e-7), name
            else:
                assert arr == state[name], (name, arr, state[name])
        kv.load_optimizer_states(path)
kv.barrier()
print('SERVER-DEVICE-OK', flush=True)
"""


OPTS = {"sgd": "SGD", "adam": "Adam"}


def run(cluster, tmp_path, device: str, opt: str) -> str:
    env = {
        "HETPS_SERVER_DEVICE": device,
        "HETPS_CHUNK_BYTES": "4096",
        "OPT": opt,
        "OUT": str(tmp_path),
    }
    rc, out = cluster(CODE, workers=2, servers=1, env=env)
    assert rc == 0, out
    assert out.count("SERVER-DEVICE-OK") == 2, out
    return out


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_server_on_a_device_gives_the_numpy_optimizers_weights(cluster, tmp_path, opt):
    out = run(cluster, tmp_path, "torch:cpu", opt)
    said = f"summing on cpu (HETPS_SERVER_DEVICE=torch:cpu), {OPTS[opt]} steps on the device"
    assert said in out, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_server_on_a_gpu_gives_the_numpy_optimizers_weights(cluster, tmp_path, opt):
    out = run(cluster, tmp_path, "cuda:0", opt)
    assert f"summing on cuda:0 (HETPS_SERVER_DEVICE=cuda:0), {OPTS[opt]} steps on the device" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine with no CUDA device")
def test_a_server_without_cuda_says_so_at_its_start():
    env = {
        **os.environ,
        "DMLC_ROLE": "server",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "9",  # never reached: the server stops before it connects
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "1",
        "HETPS_SERVER_DEVICE": "cuda:0",
    }
    r = subprocess.run(
        [sys.executable, "-m", "hetps.cli", "server"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "HETPS_SERVER_DEVICE=cuda:0 but torch sees no CUDA device" in r.stderr, r.stderr
    assert "use HETPS_SERVER_DEVICE=cpu" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_hetps_launch_puts_its_servers_on_the_device_it_is_given(tmp_path):
    """`hetps launch --server-device` reaches the servers (hetps train's flag goes the same
    way, through the launcher's environment)."""
    script = tmp_path / "w.py"
    script.write_text(
        "import numpy as np, hetps.kv\n"
        "from hetps import optim\n"
        "kv = hetps.kv.create('dist_sync')\n"
        "kv.init('w', np.ones(4, np.float32))\n"
        "kv.set_optimizer(optim.SGD(learning_rate=0.5))\n"
        "kv.push('w', np.ones(4, np.float32))\n"
        "print('PULLED', kv.pull('w').tolist(), flush=True)\n"
    )
    env = {**os.environ, "PS_HEARTBEAT_INTERVAL": "0.5", "PS_HEARTBEAT_TIMEOUT": "5"}
    cmd = [sys.executable, "-m", "hetps.cli", "launch", "-n", "1", "-s", "1"]
    r = subprocess.run(
        [*cmd, "--server-device", "torch:cpu", "--", sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "summing on cpu (HETPS_SERVER_DEVICE=torch:cpu), SGD steps on the device" in out, out
    assert "PULLED [0.5, 0.5, 0.5, 0.5]" in out, out


def test_hetps_train_gives_its_servers_the_device_and_its_workers_no_flag(monkeypatch):
    """`hetps train --workers W --server-device D`: D reaches every role's environment; the
    workers' own command line (this command again) goes without the flag."""
    import hetps.launch.local as local
    from hetps.app.train import launch_cluster
    from hetps.cli import build_parser

    seen = {}

    def fake_run_cluster(spec, **kw):
        seen["env"], seen["command"] = dict(spec.env), list(spec.command)
        return 0

    monkeypatch.setattr(local, "run_cluster", fake_run_cluster)
    argv = ["train", "--workers", "2", "--servers", "1", "--server-device", "torch:cpu"]
    monkeypatch.setattr(sys, "argv", ["hetps", *argv])
    assert launch_cluster(build_parser().parse_args(argv)) == 0
    assert seen["env"]["HETPS_SERVER_DEVICE"] == "torch:cpu"
    assert "--server-device" not in seen["command"] and "torch:cpu" not in seen["command"]
