"""Configuration as one table: the parser, ``hetps config``, docs/CONFIG.md and the rule that
only ``hetps.config`` reads the environment all come from ``hetps.config.SECTIONS``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import hetps.optim  # noqa: F401 - the optimizers register (HETPS_OPTIMIZERS), as in `hetps`
from hetps import config_report
from hetps.cli import main as cli_main
from hetps.config import BY_NAME, VARS, ConfigError, env_value, node_config_from_env

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "hetps"
#: a variable name of the families hetps owns or borrows (names built at run time escape it)
NAME = re.compile(r"\b(?:HETPS|DMLC|PS|MXNET)_[A-Z0-9_]*[A-Z0-9]\b")

BASE = {
    "DMLC_ROLE": "worker",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
    "DMLC_NUM_SERVER": "2",
    "DMLC_NUM_WORKER": "3",
}


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_variable_named_in_the_source_is_in_the_table():
    named = {}
    for path in _sources():
        for m in NAME.finditer(path.read_text()):
            named.setdefault(m.group(), path.relative_to(ROOT))
    missing = {n: str(p) for n, p in named.items() if n not in BY_NAME}
    assert not missing, f"add these to the table in src/hetps/config/table.py: {missing}"


def _environ_reads(tree: ast.AST) -> list[int]:
    """Lines that read ``os.environ``/``os.getenv`` other than copying the whole environment
    for a child process (``dict(os.environ)``, ``dict(os.environ if x is None else x)``)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def copied(node: ast.AST) -> bool:
        up = parents.get(node)
        if isinstance(up, ast.IfExp) and node is not up.test:
            node, up = up, parents.get(up)
        return (
            isinstance(up, ast.Call)
            and isinstance(up.func, ast.Name)
            and up.func.id == "dict"
            and node in up.args
        )

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if not (node.attr == "environ" and copied(node)):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "getenv", "environb"}:
                lines.append(node.lineno)
    return sorted(lines)


def test_only_config_reads_the_environment():
    reads = {}
    for path in _sources():
        if path.is_relative_to(SRC / "config"):
            continue
        lines = _environ_reads(ast.parse(path.read_text()))
        if lines:
            reads[str(path.relative_to(ROOT))] = lines
    assert not reads, f"read configuration through hetps.config (env_value etc.), not: {reads}"


def test_environ_check_catches_reads_and_allows_copies():
    src = (
        "import os\nfrom os import getenv\n"
        "a = os.environ.get('X')\nb = os.environ['Y']\nc = os.getenv('Z')\n"
        "d = dict(os.environ)\ne = dict(os.environ if base is None else base)\n"
    )
    assert _environ_reads(ast.parse(src)) == [2, 3, 4, 5]


def test_docs_config_md_is_the_generated_table():
    committed = (ROOT / "docs" / "CONFIG.md").read_text()
    assert committed == config_report.markdown(), (
        "docs/CONFIG.md is stale: run `hetps config --markdown > docs/CONFIG.md`"
    )


def test_docs_table_has_every_variable_with_its_default():
    md = config_report.markdown()
    for v in VARS:
        for name in v.names:
            assert f"`{name}`" in md
    assert "| `HETPS_CHUNK_BYTES` | integer (bytes) | 4194304 (4 MiB) | >= 4096 |" in md
    assert "| `DMLC_ROLE` | choice | required | scheduler, server, worker |" in md


@pytest.fixture
def clean_env(monkeypatch):
    """The process environment without any variable of the table."""
    for v in VARS:
        for name in v.names:
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _config(capsys, *argv: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    code = cli_main(["config", *argv])
    out, err = capsys.readouterr()
    rows = {}
    for line in out.splitlines()[1:]:
        if line.startswith("#"):
            continue
        name, value, source = re.match(r"(\S+)\s+(.+?)\s{2,}(.+)$", line).groups()
        rows[name] = (value, source)
    return code, rows, err


def test_hetps_config_lists_every_variable_without_a_cluster(clean_env, capsys):
    code, rows, err = _config(capsys)
    assert code == 0 and err == ""
    assert list(rows) == [n for v in VARS for n in v.names]
    assert rows["HETPS_BIGARRAY_BOUND"] == ("-", "another name of MXNET_KVSTORE_BIGARRAY_BOUND")
    assert rows["HETPS_CHUNK_BYTES"] == ("4194304 (4 MiB)", "default")
    assert rows["DMLC_ROLE"] == ("-", "not set (required)")
    assert rows["HETPS_NETEM_NODE"] == ("-", "not set")


def test_hetps_config_says_where_each_value_came_from(clean_env, capsys):
    for k, v in {
        **BASE,
        "DMLC_PS_ROOT_URI": "localhost",
        "HETPS_BIGARRAY_BOUND": "77",
        "HETPS_PROBE_PROB": "3",
        "HETPS_BALANCE": "AWARE",
        "HETPS_NETEM_NODE": "2",
    }.items():
        clean_env.setenv(k, v)
    code, rows, err = _config(capsys, "--role", "server")
    assert code == 0, err
    assert rows["DMLC_ROLE"] == ("server", "command")
    assert rows["DMLC_NUM_WORKER"] == ("3", "environment")
    assert rows["DMLC_NODE_HOST"] == ("127.0.0.1", "derived from DMLC_PS_ROOT_URI (loopback)")
    assert rows["MXNET_KVSTORE_BIGARRAY_BOUND"] == ("77", "environment (HETPS_BIGARRAY_BOUND)")
    assert rows["HETPS_PROBE_PROB"] == ("1", "environment (capped at 1)")
    assert rows["HETPS_BALANCE"] == ("aware", "environment")
    assert rows["HETPS_NETEM_NODE"] == ("2", "environment")
    assert rows["HETPS_SHM_BYTES"] == ("33554432 (32 MiB)", "default")


def test_hetps_config_never_prints_the_secret(clean_env, capsys):
    secret = "f00d" * 16
    clean_env.setenv("HETPS_SECRET", secret)
    code, rows, err = _config(capsys)
    assert code == 0, err
    assert rows["HETPS_SECRET"] == ("(set, hidden)", "environment")
    assert rows["HETPS_INSECURE"] == ("0", "default")
    capsys.readouterr()
    cli_main(["config"])
    assert secret not in capsys.readouterr().out


def test_hetps_config_prints_the_error_a_node_would(clean_env, capsys):
    env = {**BASE, "HETPS_SHM_BYTES": "1000", "PS_HEARTBEAT_TIMEOUT": "0.5"}
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ConfigError) as node_error:
        node_config_from_env(env)
    code, rows, err = _config(capsys)
    assert code == 2
    assert err == f"hetps config: {node_error.value}\n"
    assert "HETPS_SHM_BYTES=1000 is too small" in err and "must exceed" in err
    assert rows["HETPS_SHM_BYTES"] == ("1000 (bad)", "environment")


def test_hetps_config_reports_bad_command_variables_too(clean_env, capsys):
    clean_env.setenv("OMP_NUM_THREADS", "many")
    code, rows, err = _config(capsys)
    assert code == 2
    assert err == (
        "hetps config: OMP_NUM_THREADS='many' is not an integer: "
        "set OMP_NUM_THREADS to an integer >= 0\n"
    )


def test_markdown_flag_prints_the_docs_table(capsys):
    assert cli_main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == config_report.markdown()


def test_every_malformed_variable_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        node_config_from_env(
            {**BASE, "HETPS_CONNECT_TIMEOUT": "soon", "HETPS_PUSH_WINDOW": "-5", "PS_PORT": "x"}
        )
    lines = str(info.value).splitlines()
    assert lines[0] == "hetps cannot join the cluster:"
    assert [ln.split("=")[0].strip() for ln in lines[1:]] == [
        "PS_PORT",
        "HETPS_CONNECT_TIMEOUT",
        "HETPS_PUSH_WINDOW",
    ]


def test_aliases_first_set_wins_and_a_malformed_one_still_fails():
    env = {**BASE, "MXNET_KVSTORE_BIGARRAY_BOUND": "9", "HETPS_BIGARRAY_BOUND": "5"}
    assert node_config_from_env(env).bigarray_bound == 9
    with pytest.raises(ConfigError, match="HETPS_BIGARRAY_BOUND='x' is not an integer: set HETPS_"):
        node_config_from_env({**env, "HETPS_BIGARRAY_BOUND": "x"})


def test_env_value_parses_one_variable():
    assert env_value("OMP_NUM_THREADS", {}) is None  # the launchers pick a share
    assert env_value("OMP_NUM_THREADS", {"OMP_NUM_THREADS": " 4 "}) == 4
    assert env_value("HETPS_SSH", {}) == "ssh"
    assert env_value("HETPS_NETEM_SCENARIO", {}) is None
    assert env_value("DMLC_ROLE", {}) is None
    with pytest.raises(ConfigError, match="DMLC_ROLE='boss' is not a role"):
        env_value("DMLC_ROLE", {"DMLC_ROLE": "boss"})
    with pytest.raises(ConfigError, match="HETPS_SHM_BYTES=5 is too small"):
        env_value("HETPS_SHM_BYTES", {"HETPS_SHM_BYTES": "5"})


def test_node_config_is_a_frozen_dataclass_of_the_table():
    import dataclasses

    cfg = node_config_from_env(BASE)
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    # the secret fills no row's field: it comes from HETPS_SECRET or HETPS_SECRET_FILE
    assert set(fields) == {v.field for v in VARS if v.field} | {"secret"}
    assert not fields["secret"].repr and cfg.secret is None
    for v in VARS:
        if v.field and not v.required:
            assert fields[v.field].default == v.default == getattr(cfg, v.field), v.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.shm_bytes = 0  # type: ignore[misc]
    assert cfg.scheduler_endpoint == "tcp://127.0.0.1:9000"
    assert dataclasses.replace(cfg, chunk_bytes=4096).chunk_bytes == 4096


def test_a_nan_is_not_a_number():
    with pytest.raises(ConfigError, match="PS_HEARTBEAT_INTERVAL='nan' is not a number"):
        node_config_from_env({**BASE, "PS_HEARTBEAT_INTERVAL": "nan"})


def test_hetps_train_reads_its_role_through_config(clean_env, capsys):
    """train.py asks config for DMLC_ROLE: a bad one is one clear line, exit 2, before any
    cluster or torch work."""
    clean_env.setenv("DMLC_ROLE", "boss")
    assert cli_main(["train", "-m", "sync"]) == 2
    assert capsys.readouterr().err == (
        "hetps train: DMLC_ROLE='boss' is not a role: "
        "set DMLC_ROLE to one of scheduler, server, worker\n"
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"HETPS_REPLICAS": "3"}, "HETPS_REPLICAS=3 asks for more copies of each key than"),
        ({"HETPS_REPLICAS": "0"}, "HETPS_REPLICAS"),
    ],
)
def test_replicas_that_cannot_work_are_refused_with_the_fix(extra, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        node_config_from_env({**BASE, **extra})
    assert node_config_from_env({**BASE, "HETPS_REPLICAS": "2"}).replicas == 2
    # the plans move a slice's copies with it
    both = node_config_from_env({**BASE, "HETPS_REPLICAS": "2", "HETPS_BALANCE": "aware"})
    assert (both.replicas, both.balance) == (2, "aware")


def test_server_device_values_and_what_they_do_not_combine_with():
    env = dict(BASE)
    assert node_config_from_env(env).server_device == "cpu"
    assert node_config_from_env({**env, "HETPS_SERVER_DEVICE": "cuda:1"}).server_device == "cuda:1"
    with pytest.raises(ConfigError, match="HETPS_SERVER_DEVICE='gpu' is not a device: set it"):
        node_config_from_env({**env, "HETPS_SERVER_DEVICE": "gpu"})
    with pytest.raises(ConfigError, match=r"HETPS_REPLICAS=2: copies of keys \(--replicas\)"):
        node_config_from_env({**env, "HETPS_SERVER_DEVICE": "cuda", "HETPS_REPLICAS": "2"})
    with pytest.raises(ConfigError, match="set HETPS_SERVER_DEVICE=cpu or HETPS_ELASTIC=0"):
        node_config_from_env({**env, "HETPS_SERVER_DEVICE": "cuda:0", "HETPS_ELASTIC": "1"})
    node_config_from_env({**env, "HETPS_REPLICAS": "2"})  # the CPU server keeps copies


def test_a_host_group_past_the_node_tables_bound_is_refused_by_name():
    """A node table carries host groups as int32 and the scheduler drops an add_node past
    that (its worker waited HETPS_CONNECT_TIMEOUT for nothing): the variable is refused."""
    worker = BASE
    assert node_config_from_env({**worker, "HETPS_HOST_GROUP": str((1 << 31) - 1)}).host_group
    for name in ("HETPS_HOST_GROUP", "GROUP_RANK"):
        with pytest.raises(ConfigError, match=rf"{name}=2147483648 is .*set {name} to"):
            node_config_from_env({**worker, name: str(1 << 31)})
