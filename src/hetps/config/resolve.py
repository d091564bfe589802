"""Reading the table against an environment: one :class:`Setting` per variable (its value,
where the value came from, the error a node would report), :func:`resolve` for many rows,
:func:`env_value` for one."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hetps.config.rows import ConfigError, Var
from hetps.config.table import BY_NAME, VARS


@dataclass
class Setting:
    """One variable resolved against an environment."""

    var: Var
    value: Any = None  # None: not set (and no default)
    source: str = "default"  # default, environment, environment (ALIAS), derived from X, ...
    raw: str | None = None
    problem: str | None = None  # the error a node would report
    missing: bool = False  # a required variable that is not set


def env_raw(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _read(var: Var, env: Mapping[str, str]) -> Setting:
    """Parse one row on its own (no derivation, no cross-variable check)."""
    found: Setting | None = None
    for name in var.names:  # the first name set wins; a malformed one is an error anyway
        raw = env_raw(env, name)
        if raw is None:
            continue
        source = "environment" if name == var.name else f"environment ({name})"
        try:
            value = var.parse(raw, name)
        except ConfigError as exc:
            return Setting(var, None, source, raw, problem=str(exc))
        if var.cap is not None and float(raw) > var.cap:
            source += f" (capped at {var.cap:g})"
        found = found or Setting(var, value, source, raw)
    if found is not None:
        return found
    if var.required and var.derive is None:
        problem = f"{var.name} is not set: set {var.name} to {var.expectation()}"
        return Setting(var, None, "not set", problem=problem, missing=True)
    if var.required or var.default is None or var.derive is not None:
        return Setting(var, None, "not set")  # a derived row's default comes after derive
    return Setting(var, var.default, "default")


def resolve(
    env: Mapping[str, str] | None = None,
    role: str | None = None,
    rows: Iterable[Var] = VARS,
) -> dict[str, Setting]:
    """Every row of ``rows`` resolved against ``env`` (default ``os.environ``), by name.

    ``role``, when given, stands for ``DMLC_ROLE``. A setting's ``problem`` is the error a
    node would report for it; nothing is raised here.
    """
    env = os.environ if env is None else env
    rows = tuple(rows)
    out: dict[str, Setting] = {}
    for var in rows:
        if var.name == "DMLC_ROLE" and role:
            out[var.name] = _read(var, {"DMLC_ROLE": role})
            out[var.name].source = "command"
        else:
            out[var.name] = _read(var, env)
    values = {n: s.value for n, s in out.items() if s.problem is None and s.value is not None}
    for var in rows:
        s = out[var.name]
        if var.derive is not None and s.value is None and s.problem is None:
            try:
                derived = var.derive(values)
            except ConfigError as exc:
                s.problem = str(exc)
            else:
                if derived is None and not var.required and var.default is not None:
                    derived = var.default, "default"
                if derived is not None:
                    s.value, s.source = derived
                    values[var.name] = s.value
    for var in rows:
        s = out[var.name]
        if var.check is not None and s.problem is None and s.value is not None:
            s.problem = var.check(s.value, values)
    return out


def join_error(settings: Iterable[Setting]) -> ConfigError | None:
    problems = [s.problem for s in settings if s.problem]
    if not problems:
        return None
    return ConfigError("hetps cannot join the cluster:\n  " + "\n  ".join(problems))


def env_value(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of variable ``name`` (a table row) in ``env`` (default ``os.environ``): its
    default when unset, None when it has none. Raises ConfigError for a malformed value."""
    var = BY_NAME[name]
    setting = _read(var, os.environ if env is None else env)
    if setting.problem is None and var.check is not None and setting.value is not None:
        setting.problem = var.check(setting.value, {var.name: setting.value})
    if setting.problem is not None and not setting.missing:
        raise ConfigError(setting.problem)
    return setting.value


def user_threads(extra: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None):
    """The ``OMP_NUM_THREADS`` the user set, as given (not parsed: a launcher forwards it
    unchanged), from ``extra`` (e.g. ``--env`` pairs) or else ``env`` (default
    ``os.environ``); None when neither sets it (a launcher then picks each process's share)."""
    for source in (extra or {}, os.environ if env is None else env):
        raw = env_raw(source, "OMP_NUM_THREADS")
        if raw is not None:
            return raw
    return None


def role_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """Return ``DMLC_ROLE`` if set (validated), else None (a single-process run)."""
    return env_value("DMLC_ROLE", env)
