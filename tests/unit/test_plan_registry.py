"""Load plans declared once: a plan registered by name (``@plan``) is offered by ``--balance``,
accepted by ``HETPS_BALANCE``, listed by ``hetps config`` and run by the planner, with no
other file touched (docs/ARCHITECTURE.md, "Adding a load plan")."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetps import config_report
from hetps.balance import PLANS, Network, make_plan
from hetps.balance.plans import plan, plan_of
from hetps.balance.service import Planner
from hetps.balance.slicing import layout
from hetps.balance.solve import largest_remainder
from hetps.cli import build_parser
from hetps.config import ConfigError, node_config_from_env
from hetps.config.table import balance_schemes

ROOT = Path(__file__).resolve().parents[2]
NAME = "equal-by-bandwidth"
ENV = {
    "DMLC_ROLE": "worker",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
    "DMLC_NUM_SERVER": "3",
    "DMLC_NUM_WORKER": "2",
}
LAUNCH = ["launch", "-n", "2", "--balance"]


def _example() -> str:
    """The worked example's code: the python block of docs/ARCHITECTURE.md's section."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Adding a load plan") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def calls():
    """The worked example of docs/ARCHITECTURE.md, registered for one test (its calls
    recorded), and gone again after it."""
    seen: list[tuple] = []
    names = {"plan": plan, "np": np, "Network": Network, "largest_remainder": largest_remainder}
    try:
        exec(_example(), names)  # noqa: S102 - the docs' own code, as a plan author adds it
        solve = PLANS[NAME].solve

        def recorded(network, total, servers=None, workers=None, **kw):
            seen.append((network, servers, workers))
            return solve(network, total, servers, workers, **kw)

        PLANS[NAME] = dataclasses.replace(PLANS[NAME], solve=recorded)
        yield seen
    finally:
        PLANS.pop(NAME, None)


def test_a_registered_plan_is_offered_by_the_cli_and_accepted_by_config(calls, capsys):
    args = build_parser().parse_args([*LAUNCH, NAME, "--", "true"])
    assert args.balance == NAME
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--help"])
    assert f"{{none,average,elastic,aware,optimal,{NAME}}}" in capsys.readouterr().out
    cfg = node_config_from_env({**ENV, "HETPS_BALANCE": NAME.upper()})
    assert cfg.balance == NAME
    assert balance_schemes() == ("none", "average", "elastic", "aware", "optimal", NAME)
    assert f"| none, average, elastic, aware, optimal, {NAME} |" in config_report.markdown()
    with pytest.raises(ConfigError, match=f"HETPS_BALANCE='fastest' is not a scheme.*{NAME}"):
        node_config_from_env({**ENV, "HETPS_BALANCE": "fastest"})


def test_a_plan_unregistered_is_refused_again(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*LAUNCH, NAME, "--", "true"])
    assert f"invalid choice: '{NAME}'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="set HETPS_BALANCE to one of none, average"):
        node_config_from_env({**ENV, "HETPS_BALANCE": NAME})
    with pytest.raises(ValueError, match=f"unknown plan '{NAME}'; valid names: average, "):
        make_plan(NAME, 1.0, network=Network.from_rates([1.0]))


def test_the_planner_runs_a_registered_plan_by_its_properties(calls):
    net = Network.from_rates([1.0, 3.0, 4.0])
    np.testing.assert_allclose(make_plan(NAME, 16.0, network=net), [2.0, 6.0, 8.0])
    np.testing.assert_array_equal(make_plan(NAME, 1.0, network=net, n_slices=8), [1, 3, 4])
    with pytest.raises(ValueError, match=f"{NAME} needs network"):
        make_plan(NAME, 1.0)
    assert plan_of(NAME).needs == "network"  # (the agent probes for it)
    p = Planner(
        NAME, num_workers=2, num_servers=3, colocate=False, slice_elems=100, margin=0, patience=1
    )
    p.slices = layout([12000], 100)
    p.assignment = np.array([0, 1, 2] * 40, dtype=np.int64)
    for s, rate in enumerate((10e6, 100e6, 100e6)):  # server 0's links: a tenth of the others'
        for w in (3, 4):
            p.table.observe(s, w, rate, 0.0, 1.0)
            p.table.observe(w, s, rate, 0.0, 1.0)
    out = p.plan()
    network, servers, workers = calls[-1]
    assert (network.n_nodes, servers, workers) == (5, [0, 1, 2], [3, 4])
    assert out["epoch"] == 1 and out["shares"][0] < out["shares"][1] / 5
    p.links.spread_targets = lambda live=None: ["out", 0, [1]]  # (the next spread probe)
    assert p.spread_targets() == ["out", 0, [1]]  # a probing plan: its spreads are asked for
    assert p.history == [[], [], []]  # (only a plan of history keeps one)


def test_a_taken_name_or_unknown_needs_is_refused(calls):
    for name, needs in ((NAME, "network"), ("aware", "network"), ("none", "nothing")):
        with pytest.raises(ValueError, match="the name is taken"):
            plan(name, needs=needs)
    with pytest.raises(ValueError, match="needs 'links'"):
        plan("other", needs="links")  # type: ignore[arg-type]
    assert list(PLANS) == ["average", "elastic", "aware", "optimal", NAME]


def test_config_loads_the_registry_it_checks_against():
    """A process that never imported hetps.balance judges HETPS_BALANCE as every other does:
    config loads the registry by name when it checks a set value, and refuses a wrong name."""
    code = (
        "import sys\n"
        "from hetps.config import node_config_from_env as read, ConfigError\n"
        f"env = {{**{ENV!r}, 'HETPS_BALANCE': 'Aware'}}\n"
        "print(read(env).balance, 'hetps.balance' in sys.modules)\n"
        "import hetps.balance\n"
        "print(read(env).balance)\n"
        "try:\n"
        "    read({**env, 'HETPS_BALANCE': 'awre'})\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[:2] == ["aware True", "aware"]
    assert "HETPS_BALANCE='awre' is not a scheme: set HETPS_BALANCE to one of none, av" in out[-1]
