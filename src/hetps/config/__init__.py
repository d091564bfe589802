"""The one place where hetps reads environment variables: every variable, in one table.

Each :class:`Var` row says a variable's name (and MXNet/ps-lite aliases), the
:class:`NodeConfig` field it fills, its type, default, bounds and what it means. From the
table come the parser (:func:`node_config_from_env`, :func:`env_value`), its errors (a
:class:`ConfigError` names the variable and the fix), :class:`NodeConfig` itself, the
reference ``docs/CONFIG.md`` (:func:`markdown`) and ``hetps config`` (:func:`report`), which
lists every variable with its value and where the value came from.

Code elsewhere never reads ``os.environ`` for configuration; it asks this package
(``tests/unit/test_config.py`` holds it to that). Its parts: :mod:`~hetps.config.rows` (a
row and its parsing), :mod:`~hetps.config.table` (the rows, their cross-variable rules),
:mod:`~hetps.config.resolve` (reading rows against an environment),
:mod:`~hetps.config.node` (:class:`NodeConfig`), :mod:`~hetps.config.security` (the cluster
secret) and :mod:`~hetps.config.addresses` (interfaces, routes, loopback).
"""

from __future__ import annotations

from hetps.config.addresses import interface_address, is_loopback, route_address
from hetps.config.node import NodeConfig, check_node_env, node_config_from_env
from hetps.config.resolve import Setting, env_value, resolve, role_from_env, user_threads
from hetps.config.rows import REQUIRED, Check, ConfigError, Derive, Var
from hetps.config.security import check_exposure, private_state_dir, security_from_env
from hetps.config.table import (
    BY_NAME,
    LOOPBACK,
    MIN_SECRET_CHARS,
    NODE_VARS,
    ROLES,
    SECTIONS,
    VARS,
)

__all__ = [
    "BY_NAME",
    "LOOPBACK",
    "MIN_SECRET_CHARS",
    "NODE_VARS",
    "REQUIRED",
    "ROLES",
    "SECTIONS",
    "VARS",
    "Check",
    "ConfigError",
    "Derive",
    "NodeConfig",
    "Setting",
    "Var",
    "check_exposure",
    "check_node_env",
    "env_value",
    "interface_address",
    "is_loopback",
    "node_config_from_env",
    "private_state_dir",
    "resolve",
    "role_from_env",
    "route_address",
    "security_from_env",
    "user_threads",
]
