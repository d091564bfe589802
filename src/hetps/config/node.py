"""How one process joins a cluster: :class:`NodeConfig`, made from the table's rows with a
``field``, and :func:`node_config_from_env`, which parses it (every problem in one error)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hetps.config.resolve import join_error, resolve
from hetps.config.rows import KINDS, ConfigError
from hetps.config.security import check_exposure, security_from_env
from hetps.config.table import NODE_VARS


def _make_node_config() -> type:
    fields = []
    for v in sorted(NODE_VARS, key=lambda v: not v.required):  # required ones first
        typ = KINDS[v.kind][0]
        annotation = typ if v.default is not None else typ | None
        default = () if v.required else (dataclasses.field(default=v.default),)
        fields.append((v.field, annotation, *default))

    # the secret is no row's field: it comes from HETPS_SECRET or HETPS_SECRET_FILE, and a
    # repr (a log line, a traceback) never shows it
    fields.append(("secret", bytes | None, dataclasses.field(default=None, repr=False)))

    def scheduler_endpoint(self) -> str:
        """The scheduler's ZeroMQ endpoint, ``tcp://host:port``."""
        return f"tcp://{self.root_uri}:{self.root_port}"

    doc = "How one process joins a hetps cluster; fields from the variables:\n\n" + "\n".join(
        f"* ``{v.field}``: ``{v.name}``, {v.meaning}" for v in NODE_VARS
    )
    cls = dataclasses.make_dataclass(
        "NodeConfig",
        fields,
        frozen=True,
        namespace={"scheduler_endpoint": property(scheduler_endpoint), "__doc__": doc},
    )
    cls.__module__ = "hetps.config"  # where users import it from
    return cls


#: How one process joins a hetps cluster: a frozen dataclass made from the table's rows
#: with a ``field`` (``root_uri``, ``num_server``, ``shm_bytes``, ...) plus
#: ``scheduler_endpoint``.
NodeConfig = _make_node_config()


def node_config_from_env(env: Mapping[str, str] | None = None, role: str | None = None):
    """Parse a :class:`NodeConfig` from ``env`` (default ``os.environ``).

    ``role`` overrides ``DMLC_ROLE``. Raises :class:`ConfigError` listing every missing or
    malformed variable with the fix.
    """
    env = os.environ if env is None else env
    settings = resolve(env, role, NODE_VARS)
    error = join_error(settings.values())
    if error is not None:
        raise error
    values = {v.field: settings[v.name].value for v in NODE_VARS}
    secret, values["insecure"] = security_from_env(env)
    # the scheduler listens on DMLC_PS_ROOT_URI (every interface unless it is loopback),
    # the others on their own address
    role = values["role"]
    check_exposure(
        secret,
        values["insecure"],
        [values["root_uri"]] if role == "scheduler" else [values["root_uri"], values["node_host"]],
        role,
    )
    return NodeConfig(**values, secret=secret)


def check_node_env(env: Mapping[str, str] | None = None) -> None:
    """Check the node variables ``env`` (default ``os.environ``) sets as
    :func:`node_config_from_env` does, without asking for those only a cluster needs (a local
    store's: a bad value is refused there too, not ignored). Raises :class:`ConfigError`
    listing every malformed variable with the fix."""
    settings = resolve(os.environ if env is None else env, None, NODE_VARS)
    problems = [s.problem for s in settings.values() if s.problem and not s.missing]
    if problems:
        raise ConfigError("\n  ".join(["hetps cannot use this configuration:", *problems]))


def user_malloc(env: Mapping[str, str] | None = None) -> list[str]:
    """The variables by which this process's environment sets glibc's malloc itself (any
    ``MALLOC_*``: MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, ...; or a ``glibc.malloc``
    tunable in GLIBC_TUNABLES): ``HETPS_KEEP_BUFFERS`` then leaves malloc as they say."""
    env = os.environ if env is None else env
    mine = sorted(v for v in env if v.startswith("MALLOC_"))
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        mine.append("GLIBC_TUNABLES")
    return mine


def bulk_channels_on(cfg: Any) -> bool:
    """Whether a secured node offers bulk channels (``HETPS_BULK_CHANNELS``): 1 yes, 0 no,
    -1 (the default) yes unless ``HETPS_BALANCE`` plans the job: its link readings are
    noisier on them when the cores are busy (docs/BALANCE.md, "Measurement")."""
    return cfg.bulk_channels > 0 or (cfg.bulk_channels < 0 and cfg.balance == "none")
