"""docs/ARCHITECTURE.md's layering is the code's: every module of ``src/hetps`` belongs to a
layer the page lists, and imports (at the top or inside a function) only its own layer and
the layers above it, but for the one exception the page states."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "hetps"
#: modules that are not a layer of their own: the layer they belong to
ALIASES = {"config_report": "config", "kv": "roles"}
#: the last layers of the list, outside the library: no library module imports them
OUTSIDE_THE_LIBRARY = ("launch", "app", "cli")


def layers() -> list[set[str]]:
    """The layers in the page's order, top first: the first word of each unindented line of
    its first code block (``a/b`` would be one layer of two packages)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    return [set(m.split("/")) for m in re.findall(r"^(\S+)\s", block, re.M)]


def rank(layer: str, order: list[set[str]]) -> int:
    return next(i for i, names in enumerate(order) if layer in names)


def layer_of(module: str) -> str | None:
    """The layer of ``hetps.x.y`` (``x``); None for the package itself."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return ALIASES.get(parts[1], parts[1])


@cache
def modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def absolute(path: Path, level: int, module: str | None) -> str:
    """The module ``from <level dots><module> import ...`` in ``path`` names."""
    if level == 0:
        return module or ""
    package = list(path.relative_to(SRC.parent).parent.parts)
    return ".".join(package[: len(package) - level + 1] + ([module] if module else []))


@cache
def imports(path: Path) -> frozenset[str]:
    """Every hetps module a file imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            # ``from pkg import sub`` imports the submodule, ``from pkg import name`` the package
            base = absolute(path, node.level, node.module)
            names = (f"{base}.{a.name}" for a in node.names)
            out |= {m if m in modules() else base for m in names}
    return frozenset(m for m in out if m == "hetps" or m.startswith("hetps."))


def upward_imports(order: list[set[str]]) -> list[str]:
    bad = []
    for mod, path in modules().items():
        here = layer_of(mod)
        if here is None:
            continue
        for imp in imports(path):
            there = layer_of(imp)
            if imp == "hetps.__version__" or there is None:
                continue
            if rank(there, order) > rank(here, order):
                bad.append(f"{mod} ({here}) imports {imp} ({there}), a layer below it")
    return bad


def test_every_module_belongs_to_a_layer_the_page_lists():
    order = layers()
    listed = set().union(*order)
    missing = sorted(
        {layer_of(m) for m in modules() if layer_of(m) is not None} - listed - {"__version__"}
    )
    assert not missing, f"docs/ARCHITECTURE.md lists no layer for: {missing}"


def test_no_module_imports_a_layer_below_its_own():
    bad = upward_imports(layers())
    assert not bad, "\n".join(bad)


def test_the_app_and_the_launchers_sit_below_the_library():
    """`hetps train` (app) starts clusters through launch and is started by cli: the three are
    the last layers, in that order, so no library module can import any of them."""
    order = layers()
    assert [rank(layer, order) for layer in OUTSIDE_THE_LIBRARY] == [
        len(order) - 3,
        len(order) - 2,
        len(order) - 1,
    ]
    users = {
        m
        for m, path in modules().items()
        if any(layer_of(i) == "app" for i in imports(path)) and layer_of(m) not in ("app", "cli")
    }
    assert not users, f"library modules import hetps.app: {sorted(users)}"


def test_the_check_sees_an_import_from_below():
    """The layers upside down: every import that was upward is now downward, and is found."""
    assert upward_imports(layers()[::-1])


def architecture() -> str:
    return (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_metrics_imports_config_only():
    assert "(imports config only)" in architecture()
    bad = {
        (m, i)
        for m in modules()
        if m.startswith("hetps.metrics")
        for i in imports(modules()[m])
        if layer_of(i) not in ("metrics", "config")
    }
    assert not bad, bad


def test_the_pure_balance_modules_import_nothing_of_hetps_but_each_other():
    text = architecture()
    assert "The pure modules of `balance` import nothing of hetps but each other" in text
    listed = re.search(r"pure:\s+(.*?)\n\s+service:", text, re.S).group(1)
    pure = set(re.sub(r"\([^)]*\)", "", listed).replace(",", " ").split())
    assert {"network", "plans", "solve", "slicing", "estimate", "links", "surprise"} <= pure
    for name in pure:
        mod = f"hetps.balance.{name}"
        assert mod in modules(), f"ARCHITECTURE.md lists balance.{name}, which is not a module"
        bad = {i for i in imports(modules()[mod]) if not i.startswith("hetps.balance")}
        assert not bad, f"{mod} imports {bad}"


def test_the_kvstore_imports_nothing_of_metrics():
    """The composition root (roles) makes a worker's meter and plugs it into the store: no
    module of kvstore imports metrics, at the top or inside a function."""
    assert "kvstore imports nothing of `metrics`" in architecture()
    bad = {
        (m, i)
        for m in modules()
        if m.startswith("hetps.kvstore")
        for i in imports(modules()[m])
        if layer_of(i) == "metrics"
    }
    assert not bad, bad


def test_no_part_reaches_through_a_host_to_its_van():
    """A part talks to its peers through the port it is given (PeerLinks), never through
    another object's van (``node.van.``, ``sched.van.``), outside the transport layer."""
    bad = [
        f"{path.relative_to(ROOT)}:{n}"
        for mod, path in modules().items()
        if layer_of(mod) != "transport"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b(node|sched)\.van\.", line)
    ]
    assert not bad, bad


#: the names a part calls its host by
HOSTS = {"node", "sched", "server", "kv", "run", "links", "live", "agg"}
#: modules whose every function takes its host by its port, not only a part's __init__
EVERY_FUNCTION = {
    "hetps.kvstore.hostagg",
    "hetps.kvstore.hostrounds",
    "hetps.metrics.dashboard",
    "hetps.metrics.live",
    "hetps.metrics.prom",
    "hetps.torch.collectives",
}


def test_no_part_takes_its_host_typed_any():
    """A part of the fault wing, of the cluster's hosts or of the store takes the port of its
    family (cluster/ports.py, kvstore/ports.py, transport/links.py), never a host typed Any;
    in the host aggregation, live metrics and the collectives no function does."""
    bad = []
    for mod, path in modules().items():
        if layer_of(mod) not in ("faults", "cluster") and mod not in (
            "hetps.kvstore.dense",
            "hetps.kvstore.pipeline",
            "hetps.esync.service",
            *EVERY_FUNCTION,
        ):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef) and (fn.name == "__init__" or mod in EVERY_FUNCTION):
                for a in fn.args.args:
                    if a.arg in HOSTS and (
                        a.annotation is None or ast.unparse(a.annotation) == "Any"
                    ):
                        bad.append(f"{mod}:{fn.lineno} {a.arg}")
    assert not bad, bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of two or more modules that import each other, directly or through a chain
    (the strongly connected components of the import graph, Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    """Which modules of src each module imports (at the top, inside a function or under
    ``TYPE_CHECKING``); ``from pkg import sub`` is an arrow to ``pkg.sub``."""
    return {m: {i for i in imports(p) if i in modules() and i != m} for m, p in modules().items()}


def test_no_two_modules_import_each_other():
    """Imports run one way: a part names what it uses of its host by a port, and what two
    files share lives in the one they both import (docs/ARCHITECTURE.md)."""
    found = circles(import_graph())
    assert not found, "modules that import each other:\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_check_sees_a_circle_through_a_chain():
    """config.table imports nothing of hetps; an arrow from it to the van (which reaches it
    through a chain) makes a circle the check finds."""
    graph = import_graph()
    assert not any("hetps.config.table" in c for c in circles(graph))
    assert "hetps.config.table" not in graph["hetps.transport.van"]  # (a chain, not a pair)
    graph["hetps.config.table"] = graph["hetps.config.table"] | {"hetps.transport.van"}
    assert any({"hetps.config.table", "hetps.transport.van"} <= set(c) for c in circles(graph))
