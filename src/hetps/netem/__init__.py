"""Network emulation for hetps: Linux namespaces + veth + bridge + tc shaping.

``Scenario`` (pure) says which rate every node has in every epoch; ``Netem`` builds the
namespaces and applies the rates with ``tc``; ``DynamicDriver`` re-applies them every period.
See docs/NETEM.md.
"""

from hetps.netem.dynamic import DynamicDriver
from hetps.netem.emulator import Netem
from hetps.netem.scenario import Scenario, ScenarioError, load_scenario
from hetps.netem.tools import (
    DEFAULT_PREFIX,
    NetemError,
    NetemPermissionError,
    NetemUnsupportedError,
    RunInfo,
    cleanup_stale,
    goodput_mbit,
    list_runs,
    require_root,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DynamicDriver",
    "Netem",
    "NetemError",
    "NetemPermissionError",
    "NetemUnsupportedError",
    "RunInfo",
    "Scenario",
    "ScenarioError",
    "cleanup_stale",
    "goodput_mbit",
    "list_runs",
    "load_scenario",
    "require_root",
]
