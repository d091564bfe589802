"""RayLauncher's options without a Ray cluster: its refusals, its defaults, and a repr that
shows none of the job's environment (it holds the cluster secret where the caller set one)."""

from __future__ import annotations

import io
import sys

import pytest

from hetps.launch.ray import RayLauncher


def test_refusals():
    with pytest.raises(ValueError, match="^a job needs at least one worker and one server$"):
        RayLauncher(["python", "t.py"], 0, 1)
    with pytest.raises(ValueError, match="^give the worker command$"):
        RayLauncher([], 1, 1)


def test_defaults_and_copies(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.chdir(tmp_path)
    env, command = {"A": "1"}, ("python", "t.py")
    r = RayLauncher(command, 2, 1, env=env)
    assert (r.address, r.cwd, r.command, r.init_kwargs) == (
        "ray://head:10001",
        str(tmp_path),
        list(command),
        {},
    )
    assert r.env == env and r.env is not env
    out = io.StringIO()
    r = RayLauncher(command, 1, 1, address="local", out=out)
    assert (r.address, r.out, RayLauncher(command, 1, 1).out) == ("local", out, sys.stdout)


def test_repr_shows_no_environment_value():
    r = RayLauncher(
        ["python", "t.py"],
        1,
        1,
        env={"HETPS_SECRET": "0123abcd" * 8},
        init_kwargs={"runtime_env": {"env_vars": {"TOKEN": "t0ps3cret"}}},
    )
    text = repr(r)
    assert "0123abcd" not in text and "t0ps3cret" not in text
    assert text == object.__repr__(r)
