"""Server optimizers declared once: an optimizer registered by name (``@optimizer``) is offered
by ``hetps train --server-optimizer``, accepted by ``HETPS_OPTIMIZERS``, listed by ``hetps
config``, run by a server, and its ``device_step`` run on a device server (torch's CPU device
and the stand-in of torch.cuda), with no other file touched (docs/ARCHITECTURE.md, "Adding a
server optimizer")."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from hetps import config_report, optim
from hetps.cli import build_parser
from hetps.config import ConfigError, node_config_from_env
from hetps.optim import registry
from hetps.optim.base import Optimizer, compute_dtype

ROOT = Path(__file__).resolve().parents[2]
NAME = "signsgd"
ENV = {
    "DMLC_ROLE": "server",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
    "DMLC_NUM_SERVER": "1",
    "DMLC_NUM_WORKER": "1",
}
TRAIN = ["train", "-m", "async", "--server-optimizer"]


def _example() -> str:
    """The worked example's code: the python block of docs/ARCHITECTURE.md's section."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Adding a server optimizer") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_example() -> type:
    names = {"optimizer": optim.optimizer, "Optimizer": Optimizer, "np": np}
    names["compute_dtype"] = compute_dtype
    exec(_example(), names)  # noqa: S102 - the docs' own code, as an optimizer's author adds it
    return names["SignSGD"]


@pytest.fixture
def sign_sgd(monkeypatch):
    """The worked example of docs/ARCHITECTURE.md, registered for one test, gone after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return _run_example()


def test_a_registered_optimizer_is_offered_by_the_cli_and_accepted_by_config(sign_sgd, capsys):
    assert optim.registered()[NAME] is sign_sgd
    assert build_parser().parse_args([*TRAIN, NAME]).server_optimizer == NAME
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert f"{{adagrad,adam,dcasgd,sgd,{NAME}}}" in capsys.readouterr().out
    cfg = node_config_from_env({**ENV, "HETPS_OPTIMIZERS": f"sgd,{NAME.upper()}"})
    assert cfg.optimizers == f"sgd,{NAME.upper()}"
    assert f"| any, registered, adagrad, adam, dcasgd, sgd, {NAME} |" in config_report.markdown()
    with pytest.raises(ConfigError, match=f"HETPS_OPTIMIZERS names 'rmsprop'.*sgd, {NAME}"):
        node_config_from_env({**ENV, "HETPS_OPTIMIZERS": "sgd,rmsprop"})
    assert type(optim.create(NAME, learning_rate=0.5)) is sign_sgd


def test_an_optimizer_unregistered_is_refused_again(capsys):
    assert NAME not in optim.registered_names()
    with pytest.raises(SystemExit):
        build_parser().parse_args([*TRAIN, NAME])
    assert f"invalid choice: '{NAME}'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"HETPS_OPTIMIZERS names '{NAME}'"):
        node_config_from_env({**ENV, "HETPS_OPTIMIZERS": NAME})
    with pytest.raises(ValueError, match=f"unknown optimizer '{NAME}'"):
        optim.create(NAME)


@pytest.mark.parametrize("where", ["torch:cpu", "standin"])
def test_its_device_step_is_found_and_gives_the_host_steps_weights(sign_sgd, where, capsys):
    """The device aggregator runs the example's own device_step (on torch's CPU device, and
    on the stand-in of torch.cuda), and the weights equal the host step's bit for bit."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from test_device_aggregator import orders, pair, round_of

    (cpu, a), (dev, b) = pair(sign_sgd(learning_rate=0.01), np.float32, where=where)
    rng = np.random.default_rng(7)
    for _ in range(3):
        grads = [rng.standard_normal(a.value.size).astype(np.float32) for _ in range(3)]
        order = orders(rng)
        round_of(cpu, a, grads, order)
        round_of(dev, b, grads, order)
        assert b.value.tobytes() == a.value.tobytes()
    assert dev.slots[("w", 0)].weight is not None  # it stepped on the device
    assert "SignSGD steps on the device" in capsys.readouterr().err


SERVER_RUN = """
kv = hetps.kv.create('dist_sync')
n = 3000
w0 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
kv.init('w', w0)
opt = optim.create('signsgd', learning_rate=0.01)   # its class goes to the server by value
kv.set_optimizer(opt)
ref = w0.copy()
for rnd in range(3):
    g = np.random.default_rng(rnd).standard_normal(n).astype(np.float32)
    kv.push('w', g)
    got = kv.pull('w')
    opt.update(('w', 0), ref, g, None)
    assert got.tobytes() == ref.tobytes(), ('round', rnd, np.abs(got - ref).max())
print('SIGNSGD-OK', flush=True)
"""


def test_a_server_runs_it_on_its_device(cluster):
    """A real cluster: the worker registers the example in its script and sends it; the
    server (HETPS_SERVER_DEVICE=torch:cpu) steps it with its device_step, every round's
    weights equal to the host step's."""
    pytest.importorskip("torch")
    code = "from hetps.optim import Optimizer, compute_dtype, optimizer\n" + _example()
    # registered in the worker's script only: the server takes its class by value with any
    env = {"HETPS_SERVER_DEVICE": "torch:cpu", "HETPS_OPTIMIZERS": "any"}
    rc, out = cluster(code + SERVER_RUN, workers=1, servers=1, env=env)
    assert rc == 0, out
    assert "SIGNSGD-OK" in out, out
    assert "summing on cpu (HETPS_SERVER_DEVICE=torch:cpu), SignSGD steps on the device" in out
