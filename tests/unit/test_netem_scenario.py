"""Scenario parsing and rate schedules of hetps.netem (pure: no namespaces, no root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hetps.netem import Scenario, ScenarioError, load_scenario
from hetps.netem import emulator as emu
from hetps.netem import tools as netem_tools
from hetps.netem.cli import build_parser, main, scenario_from_args

# -- parsing -------------------------------------------------------------------------------


def test_static_rates_from_toml_file(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[network]\nkind = "static"\nrates_mbit = [20, 80, 80.5]\ndelay_ms = 5\n')
    sc = load_scenario(f)
    assert sc.kind == "static" and not sc.dynamic
    assert sc.nodes == 3
    assert sc.rates_at(0) == [20.0, 80.0, 80.5]
    assert sc.rates_at(7) == [20.0, 80.0, 80.5]
    assert sc.delay_ms == (5.0, 5.0, 5.0)
    assert sc.period_s is None and sc.pair_rates_mbit is None


def test_dict_with_or_without_network_table_is_the_same() -> None:
    net = {"kind": "static", "rates_mbit": [10, 20]}
    assert Scenario.from_dict({"network": net}) == Scenario.from_dict(net)


def test_nodes_override_agrees_with_rates() -> None:
    assert Scenario.from_dict({"kind": "static", "rates_mbit": [1, 2]}, nodes=2).nodes == 2
    with pytest.raises(ScenarioError, match=r"rates_mbit.*2 rates but nodes = 3"):
        Scenario.from_dict({"kind": "static", "rates_mbit": [1, 2]}, nodes=3)


def test_drawn_rates_are_uniform_in_range_and_deterministic_per_seed() -> None:
    d = {"kind": "dynamic", "lo_mbit": 20, "hi_mbit": 220, "seed": 7, "period_s": 300, "nodes": 12}
    a, b = Scenario.from_dict(d), Scenario.from_dict(d)
    for epoch in range(20):
        r = a.rates_at(epoch)
        assert len(r) == 12 and all(20 <= x <= 220 for x in r)
        assert r == b.rates_at(epoch)
    # any epoch can be computed on its own, in any order
    assert [a.rates_at(e) for e in (5, 1, 5)] == [b.rates_at(5), b.rates_at(1), b.rates_at(5)]
    assert a.rates_at(0) != a.rates_at(1)  # re-drawn every period
    other = Scenario.from_dict({**d, "seed": 8})
    assert other.rates_at(0) != a.rates_at(0)
    # the draw is pinned (random.Random with a str seed is stable across Python versions)
    assert a.rates_at(0)[:3] == pytest.approx([63.271884, 30.252522, 66.90032], abs=1e-6)
    many = [x for e in range(200) for x in a.rates_at(e)]
    assert 110 < sum(many) / len(many) < 130  # mean of U(20, 220) is 120


def epoch_at(sc: Scenario, elapsed_s: float) -> int:
    """The epoch current ``elapsed_s`` after the start, as DynamicDriver steps through them."""
    if not sc.dynamic or sc.period_s is None:
        return 0
    return max(0, int(elapsed_s // sc.period_s))


def test_static_drawn_rates_never_change() -> None:
    sc = Scenario.from_dict({"kind": "static", "lo_mbit": 5, "hi_mbit": 50, "seed": 1, "nodes": 4})
    assert sc.rates_at(0) == sc.rates_at(3)
    assert epoch_at(sc, 1e6) == 0


def test_dynamic_given_epochs_cycle() -> None:
    sc = Scenario.from_dict(
        {"kind": "dynamic", "rates_mbit": [[10, 20], [30, 40]], "period_s": 2.5}
    )
    assert [sc.rates_at(e) for e in range(3)] == [[10, 20], [30, 40], [10, 20]]
    assert [epoch_at(sc, t) for t in (0, 2.49, 2.5, 7.6)] == [0, 0, 1, 3]


def test_pair_rates_and_link_matrix() -> None:
    pair = [[0, 10, 100], [100, 0, 100], [5, 100, 0]]
    sc = Scenario.static([50, 80, 80], pair_rates_mbit=pair)
    assert sc.link_rates_at(0) == [[0, 10, 50], [50, 0, 80], [5, 80, 0]]


def test_pair_rates_alone_give_node_rates() -> None:
    sc = Scenario.from_dict({"kind": "static", "pair_rates_mbit": [[0, 10], [30, 0]]})
    assert sc.nodes == 2
    assert sc.rates_at(0) == [30.0, 30.0]
    assert sc.link_rates_at(0) == [[0, 10], [30, 0]]


def test_delay_per_node() -> None:
    sc = Scenario.static([1, 2], delay_ms=[0, 10])
    assert sc.delay_ms == (0.0, 10.0)


def test_tcp_cc_is_optional_and_kept() -> None:
    assert Scenario.static([1, 2]).tcp_cc is None
    sc = Scenario.from_dict({"kind": "static", "rates_mbit": [1, 2], "tcp_cc": "reno"})
    assert sc.tcp_cc == "reno"


def test_rates_at_rejects_negative_epoch() -> None:
    with pytest.raises(ValueError):
        Scenario.static([1]).rates_at(-1)


# -- validation: every error names the key and says how to fix it ---------------------------


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"kind": "wavy", "rates_mbit": [1]}, "kind"),
        ({"rates_mbit": [1]}, "kind"),
        ({"kind": "static"}, "rates_mbit"),
        ({"kind": "static", "rates_mbit": []}, "rates_mbit"),
        ({"kind": "static", "rates_mbit": [10, -1]}, "rates_mbit[1]"),
        ({"kind": "static", "rates_mbit": [10, 0]}, "rates_mbit[1]"),
        ({"kind": "static", "rates_mbit": [10, "fast"]}, "rates_mbit[1]"),
        ({"kind": "static", "rates_mbit": [float("inf")]}, "rates_mbit[0]"),
        ({"kind": "static", "rates_mbit": [1], "lo_mbit": 1, "hi_mbit": 2}, "rates_mbit"),
        ({"kind": "static", "lo_mbit": 1, "nodes": 2}, "lo_mbit/hi_mbit"),
        ({"kind": "static", "lo_mbit": 5, "hi_mbit": 2, "nodes": 2}, "hi_mbit"),
        ({"kind": "static", "lo_mbit": 1, "hi_mbit": 2}, "nodes"),
        ({"kind": "static", "rates_mbit": [1], "nodes": 0}, "nodes"),
        ({"kind": "static", "rates_mbit": [1], "nodes": 2.5}, "nodes"),
        ({"kind": "static", "rates_mbit": [1], "seed": "x"}, "seed"),
        ({"kind": "dynamic", "lo_mbit": 1, "hi_mbit": 2, "nodes": 2}, "period_s"),
        ({"kind": "dynamic", "rates_mbit": [1, 2], "period_s": 1}, "rates_mbit"),
        ({"kind": "dynamic", "rates_mbit": [[1, 2], [3]], "period_s": 1}, "rates_mbit[1]"),
        ({"kind": "dynamic", "lo_mbit": 1, "hi_mbit": 2, "nodes": 2, "period_s": 0}, "period_s"),
        ({"kind": "static", "rates_mbit": [1], "period_s": 5}, "period_s"),
        ({"kind": "static", "rates_mbit": [[1], [2]]}, "rates_mbit"),
        ({"kind": "static", "rates_mbit": [1, 2], "delay_ms": -1}, "delay_ms"),
        ({"kind": "static", "rates_mbit": [1, 2], "delay_ms": [1]}, "delay_ms"),
        ({"kind": "static", "rates_mbit": [1, 2], "pair_rates_mbit": [[0, 1]]}, "pair_rates_mbit"),
        (
            {"kind": "static", "rates_mbit": [1, 2], "pair_rates_mbit": [[0, 1], [0, 0]]},
            "pair_rates_mbit[1][0]",
        ),
        ({"kind": "static", "rates_mbit": [1], "rate_mbit": [2]}, "unknown key(s) ['rate_mbit']"),
        ({"kind": "static", "rates_mbit": [1], "tcp_cc": 3}, "tcp_cc"),
        ({"kind": "static", "rates_mbit": [1], "tcp_cc": "reno; reboot"}, "tcp_cc"),
    ],
)
def test_validation_errors_name_key_and_fix(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ScenarioError) as info:
        Scenario.from_dict(data)
    msg = str(info.value)
    assert key in msg
    assert "fix:" in msg


def test_unknown_top_level_table() -> None:
    with pytest.raises(ScenarioError, match=r"\[network\]"):
        Scenario.from_dict({"network": {"kind": "static", "rates_mbit": [1]}, "nodes": {}})


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[network\nkind=")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "nope.toml")


# -- CLI flags -> scenario (pure) ------------------------------------------------------------


def _scenario(argv: list[str]) -> Scenario:
    return scenario_from_args(build_parser().parse_args(argv))


def test_cli_flags_build_scenarios(tmp_path: Path) -> None:
    assert _scenario(["--rates", "20,80"]).rates_at(0) == [20, 80]
    sc = _scenario(["--lo", "10", "--hi", "20", "--nodes", "3", "--period", "4", "--seed", "2"])
    assert sc.dynamic and sc.nodes == 3 and sc.period_s == 4 and sc.seed == 2
    f = tmp_path / "s.toml"
    f.write_text('[network]\nkind = "static"\nrates_mbit = [1, 2, 3]\n')
    # flags override the file: other rates, another node count
    assert _scenario([str(f), "--rates", "5,6"]).rates_at(0) == [5, 6]
    assert _scenario([str(f), "--lo", "1", "--hi", "2", "--nodes", "5"]).nodes == 5
    with pytest.raises(ScenarioError, match="no rates"):
        _scenario([])
    assert _scenario(["--rates", "5,6", "--tcp-cc", "reno"]).tcp_cc == "reno"
    assert _scenario(["--rates", "5,6"]).tcp_cc is None


# -- without root: a clear refusal that points to the in-process shaper ---------------------


def test_require_root_refuses_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emu.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netem_tools, "_has_caps", lambda: False)
    with pytest.raises(emu.NetemPermissionError) as info:
        emu.require_root()
    msg = str(info.value)
    assert "root" in msg and "HETPS_SHAPE_MBIT" in msg and "less exact" in msg
    # the emulator refuses before creating anything
    with pytest.raises(emu.NetemPermissionError):
        emu.Netem([10, 10]).start()


def test_cli_without_root_exits_1_with_the_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(emu.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netem_tools, "_has_caps", lambda: False)
    assert main(["--rates", "10,10", "--", "true"]) == 1
    assert "HETPS_SHAPE_MBIT" in capsys.readouterr().err


# -- the scenario files shipped with hetps ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "nodes", "dynamic"),
    [
        ("paper_dynamic.toml", 12, True),
        ("static_hetero8.toml", 8, False),
        ("pairs4.toml", 4, False),
    ],
)
def test_shipped_scenarios_parse(name: str, nodes: int, dynamic: bool) -> None:
    import hetps.netem

    path = Path(hetps.netem.__file__).parent / "scenarios" / name
    sc = load_scenario(path)
    assert sc.nodes == nodes and sc.dynamic == dynamic
    assert all(r > 0 for r in sc.rates_at(3))
