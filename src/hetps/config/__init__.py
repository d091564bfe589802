"""The one place where hetps reads environment variables: every variable, in one table.
(docs/MODULES.md, "hetps.config")"""

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
