"""HETPS_BALANCE's and HETPS_OPTIMIZERS' values come from registries (``@plan``,
``@optimizer``) that config's code does not import; they are checked the same way in a
process that never imported ``hetps.balance`` or ``hetps.optim``: a server started with
``hetps.kv.create`` (a fresh interpreter, the real entry point) refuses an unknown plan
before it connects to anything, and a script that reads config alone refuses it too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROLE = {
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "1",  # nothing listens there: a node that got past config would wait
    "DMLC_NUM_WORKER": "1",
    "DMLC_NUM_SERVER": "1",
    "HETPS_CONNECT_TIMEOUT": "3",
}


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "HETPS_"))}
    full.update(ROLE, PYTHONPATH=str(SRC), **env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("role", ["server", "worker"])
def test_kv_create_refuses_an_unknown_plan_in_every_role(role):
    res = _run(
        "import hetps.kv; hetps.kv.create('dist_sync')", DMLC_ROLE=role, HETPS_BALANCE="bogus"
    )
    assert res.returncode == 1, res
    assert (
        "hetps.kv.create('dist_sync'): hetps cannot join the cluster:\n"
        "  HETPS_BALANCE='bogus' is not a scheme: set HETPS_BALANCE to one of none, average, "
        "elastic, aware, optimal" in res.stderr
    ), res.stderr
    assert "Traceback" not in res.stderr and "could not reach" not in res.stderr, res.stderr


CONFIG_ALONE = """
import sys
from hetps.config import ConfigError, node_config_from_env
assert 'hetps.balance' not in sys.modules and 'hetps.optim' not in sys.modules
for name, value in (('HETPS_BALANCE', 'bogus'), ('HETPS_OPTIMIZERS', 'sgd,bogus')):
    try:
        node_config_from_env({**ENV, name: value})
    except ConfigError as exc:
        print('REFUSED', exc)
    else:
        print('TAKEN', name)
print('TOOK', node_config_from_env({**ENV, 'HETPS_BALANCE': 'Aware'}).balance)
"""


def test_config_read_alone_checks_the_registries_values():
    code = f"ENV = {dict(ROLE, DMLC_ROLE='server')!r}\n{CONFIG_ALONE}"
    res = _run(code)
    assert res.returncode == 0, res
    assert "TAKEN" not in res.stdout, res.stdout
    assert "HETPS_BALANCE='bogus' is not a scheme: set HETPS_BALANCE to one of none," in res.stdout
    assert "HETPS_OPTIMIZERS names 'bogus', not a registered optimizer: set it to registered " in (
        res.stdout
    )
    assert "TOOK aware" in res.stdout, res.stdout
