"""The documents name only what exists.

Every repository path, every link between documents, every section a document cites by name or
number, every ``hetps`` command with its options and every repository script with its options
that README.md, docs/*.md and benchmarks/README.md name must be real: the file in the tree, the
heading in the page, the subcommand and option in ``hetps.cli.build_parser()`` (parsed in
process, nothing is run), the option in the script's ``add_argument`` calls, the variable in
the code. No document names a file, branch or virtualenv outside the repository.
"""

from __future__ import annotations

import argparse
import ast
import glob
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")]
)
TOP_DIRS = ("src", "benchmarks", "docs", "examples", "scripts", "tests")
#: hetps's packages: ARCHITECTURE.md names their modules as ``kvstore/server.py``
PACKAGES = tuple(
    p.name for p in (ROOT / "src" / "hetps").iterdir() if p.is_dir() and p.name[0] != "_"
)


def _rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


# --- reading a page -------------------------------------------------------------------------


def code_spans(text: str) -> list[str]:
    """Inline code spans and the logical lines of code blocks (fenced or indented by 4, with
    backslash continuations joined)."""
    out: list[str] = []
    lines = text.splitlines()
    prose: list[str] = []
    block: list[str] = []
    fenced = False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        continued = bool(block) and block[-1].endswith("\\") and line.startswith("    ")
        if (
            fenced
            or continued
            or (line.startswith("    ") and not line.lstrip().startswith(("-", "|")))
        ):
            block.append(line.strip())
        else:
            prose.append(line)
    joined = "\n".join(block).replace("\\\n", " ")
    out.extend(joined.splitlines())
    out.extend(re.findall(r"`([^`\n]+)`", "\n".join(prose)))
    return out


def headings(path: Path) -> list[str]:
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def titles(path: Path) -> list[str]:
    """The headings and the bold run-in titles (``**Burst size.** Every TBF ...``) of a page:
    what a reference like ``docs/NETEM.md, "Burst size"`` may name."""
    bold = re.findall(r"^(?:- )?\*\*([^*]+?)\.?\*\*", path.read_text(), re.M)
    return headings(path) + bold


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# --- paths ------------------------------------------------------------------------------------

_TOPS = "|".join(TOP_DIRS + PACKAGES)
_PATH = re.compile(r"(?<![\w./~-])((?:" + _TOPS + r")/[\w.*<>{}/-]*[\w*>}/])(::\w+)?")


def repo_paths(text: str) -> list[tuple[str, str | None]]:
    """``(path, test name or None)`` for every path under a top directory of the repository,
    and every module path under ``src/hetps`` named by its package (``kvstore/server.py``)."""
    out = []
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if path.split("/")[0] in PACKAGES:
            if not path.endswith(".py"):
                continue  # "cluster/state" or "torch/cuda" in prose: a package name, not a path
            path = "src/hetps/" + path
        out.append((path, m.group(2)[2:] if m.group(2) else None))
    return out


def path_problem(path: str, test: str | None) -> str | None:
    # a placeholder (<scenario>, {name}) or a wildcard: its fixed part must exist
    fixed = re.split(r"[<{]", path)[0]
    if "*" in fixed:
        return None if glob.glob(str(ROOT / fixed)) else "matches no file"
    if fixed != path:
        fixed = fixed.rsplit("/", 1)[0]
    target = ROOT / fixed
    if not target.exists():
        return "does not exist"
    if test and not re.search(rf"^\s*(?:async )?def {test}\b", target.read_text(), re.M):
        return f"has no test {test}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_repository_path_a_doc_names_exists(doc):
    bad = [
        f"{p}{'::' + t if t else ''}: {why}"
        for p, t in repo_paths(doc.read_text())
        if (why := path_problem(p, t))
    ]
    assert not bad, f"{_rel(doc)} names paths that are not in the repository: {bad}"


#: (``~/.cache/hetps`` is where hetps keeps a scheduler's key on the user's machine)
_OUTSIDE = re.compile(
    r"(?<![\w.])shared/|/work/|/home/|~/(?!\.cache/hetps)|\bbranch `|\bon branch\b"
)
_UP = re.compile(r"(?:\.\./)+[\w./-]*")


def outside(line: str, here: Path) -> bool:
    """The line names a branch, an absolute path of some machine, or a relative path that
    leads out of the repository."""
    if _OUTSIDE.search(line):
        return True
    return any(ROOT not in (here.parent / m).resolve().parents for m in _UP.findall(line))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_doc_names_anything_outside_the_repository(doc):
    bad = [line.strip() for line in doc.read_text().splitlines() if outside(line, doc)]
    assert not bad, f"{_rel(doc)} names a path or branch outside the repository: {bad}"


# --- links and section references -------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_link_resolves(doc):
    bad = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and anchor not in {slug(h) for h in headings(dest)}:
            bad.append(f"{target}: no heading with anchor #{anchor}")
    assert not bad, f"{_rel(doc)} has broken links: {bad}"


_SECTION = re.compile(r"(\w+\.md)\)?,? ?(?:\(?\"([A-Z][^\"\n]*)\"|§ ?(\d+(?:\.\d+)*))")


def section_problems(text: str, here: Path) -> list[str]:
    """``docs/X.md, "Title"`` and ``docs/X.md §N.M`` must name a heading of X."""
    bad = []
    for name, title, number in _SECTION.findall(text):
        page = next((d for d in DOCS if d.name == name and d.parent.name == "docs"), None)
        if name == "README.md" or page is None:
            if name != "README.md":
                bad.append(f"{name}: no such page in docs/")
            continue
        hs = headings(page)
        if title and not any(title.lower() in h.lower() for h in titles(page)):
            bad.append(f'{name}, "{title}": no such heading')
        if number and not any(re.match(rf"{re.escape(number)}\.?\s", h) for h in hs):
            bad.append(f"{name} §{number}: no such section")
    return bad


SOURCES = sorted(
    p
    for d in ("src", "benchmarks", "examples", "tests", "scripts")
    for p in (ROOT / d).rglob("*")
    if p.suffix in (".py", ".sh", ".toml") and p.name != "test_docs.py"
)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_section_a_doc_cites_exists(doc):
    bad = section_problems(doc.read_text(), doc)
    assert not bad, f"{_rel(doc)} cites sections that do not exist: {bad}"


def test_the_code_cites_only_pages_and_sections_that_exist():
    bad = []
    for src in SOURCES:
        text = src.read_text(errors="replace")
        for name in set(re.findall(r"docs/(\w+\.md)", text)):
            if not (ROOT / "docs" / name).exists():
                bad.append(f"{src.relative_to(ROOT)}: docs/{name}")
        bad += [f"{src.relative_to(ROOT)}: {b}" for b in section_problems(text, src)]
    assert not bad, f"the code cites pages or sections that do not exist: {bad}"


# --- hetps commands ---------------------------------------------------------------------------


@cache
def hetps_parser() -> argparse.ArgumentParser:
    from hetps.cli import build_parser

    return build_parser()


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _words(line: str) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose
        words = line.split()
    return [w.strip("[]") for w in words]


_STOP = {"|", "||", "&&", ";", ">", "2>&1", "--"}


def check_options(p: argparse.ArgumentParser, words: list[str], what: str) -> list[str]:
    """Every option in ``words`` (up to a pipe, ``--``, or the command a REMAINDER takes) is
    one of ``p``'s; an option's values are skipped."""
    bad = []
    remainder = any(a.nargs == argparse.REMAINDER for a in p._actions if not a.option_strings)
    i = 0
    while i < len(words):
        w = words[i]
        if w in _STOP or w.startswith(("|", ">")):
            break
        if w.startswith("-") and len(w) > 1 and not re.match(r"-\d", w):
            name = w.split("=", 1)[0]
            action = p._option_string_actions.get(name)
            if action is None:
                bad.append(f"{what}: no option {name}")
            elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
                while i + 1 < len(words) and not words[i + 1].startswith("-"):
                    i += 1
            elif action.nargs != 0 and "=" not in w:
                i += 1
        elif remainder:
            break  # hetps launch ... CMD: the rest is the user's command
        i += 1
    return bad


def commands(span: str) -> list[list[str]]:
    """The words of each command a code line runs: its segments between ``&&``, ``;`` and
    ``|``, each past its leading ``VAR=value`` assignments, ``sudo`` and ``timeout N``. A
    comment line, or a line that is not a command (a table, printed output), has none."""
    words = _words(span)
    out, cur = [], []
    for w in [*words, ";"]:
        if w in ("&&", "||", ";", "|"):
            while cur and (re.match(r"\w+=", cur[0]) or cur[0] in ("sudo", "$", "exec")):
                cur = cur[1:]
            if len(cur) > 1 and cur[0] == "timeout":
                cur = cur[2:]
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(w)
    return out


def hetps_words(cmd: list[str]) -> list[str] | None:
    """The arguments of a ``hetps`` command (``hetps``, ``.venv/bin/hetps``, ``python -m
    hetps.cli``), or None."""
    if cmd[0] == "hetps" or cmd[0].endswith("/hetps"):
        return cmd[1:]
    if re.search(r"python[\d.]*$", cmd[0]) and cmd[1:3] == ["-m", "hetps.cli"]:
        return cmd[3:]
    return None


#: lines hetps prints that read like a command (the scheduler's metrics address, its port),
#: each with the f-string that prints it
PRINTED = {
    "hetps metrics http": 'f"hetps metrics {',
    "hetps dashboard http": 'f"hetps dashboard {',
    "hetps scheduler port ": 'f"hetps scheduler port {',
}


def printed(span: str) -> bool:
    """A line hetps prints rather than one a user runs: one of PRINTED (which the code must
    print), or an error line (``hetps train: --replicas ...``, as ``hetps.cli.main`` writes)."""
    line = span.lstrip("#[] ").split("] ", 1)[-1]
    if re.match(r"hetps [\w-]+: ", line):
        return True
    return any(line.startswith(p) for p in PRINTED)


def hetps_problems(span: str) -> list[str]:
    if printed(span):
        return []
    bad = []
    for cmd in commands(span):
        words = hetps_words(cmd)
        if words is None:
            continue
        p, what = hetps_parser(), "hetps"
        while words and (subs := _subparsers(p)):
            if words[0] not in subs:
                bad.append(f"`{span}`: {what} has no subcommand {words[0]!r}")
                break
            what += " " + words[0]
            p, words = subs[words[0]], words[1:]
            if what == "hetps netem":  # it hands its whole command line to its own parser
                from hetps.netem.cli import build_parser as netem_parser

                p = netem_parser()
        else:
            bad += [f"`{span}`: {b}" for b in check_options(p, words, what)]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_hetps_command_and_option_a_doc_names_exists(doc):
    bad = [b for span in code_spans(doc.read_text()) for b in hetps_problems(span)]
    assert not bad, f"{_rel(doc)} names hetps commands or options that do not exist: {bad}"


# --- repository scripts -----------------------------------------------------------------------


@cache
def script_options(script: Path) -> frozenset[str]:
    """Every option string of ``add_argument`` calls in the script and in the benchmarks'
    helper modules it imports (``_common``)."""
    files = [script]
    text = script.read_text()
    files += [script.parent / f"{m}.py" for m in re.findall(r"^from (_\w+) import", text, re.M)]
    opts: set[str] = {"-h", "--help"}
    for f in files:
        if not f.exists():
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                opts |= {
                    a.value
                    for a in node.args
                    if isinstance(a, ast.Constant) and str(a.value).startswith("-")
                }
    return frozenset(opts)


_SCRIPT = re.compile(r"(?:benchmarks|examples|scripts)/[\w/.-]+\.(?:py|sh)")


def script_problems(span: str) -> list[str]:
    """A repository script a command runs exists, and takes every ``--option`` given to it."""
    bad = []
    for cmd in commands(span):
        at = next((i for i, w in enumerate(cmd) if _SCRIPT.fullmatch(w)), None)
        if at is None:
            continue
        script = ROOT / cmd[at]
        if not script.exists():
            bad.append(f"`{span}`: no script {cmd[at]}")
            continue
        for w in cmd[at + 1 :]:
            if w in _STOP or w.startswith(("|", ">")):
                break
            if w.startswith("--") and len(w) > 2 and script.suffix == ".py":
                name = w.split("=", 1)[0]
                if name not in script_options(script):
                    bad.append(f"`{span}`: {cmd[at]} has no option {name}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_script_and_option_a_doc_names_exists(doc):
    bad = [b for span in code_spans(doc.read_text()) for b in script_problems(span)]
    assert not bad, f"{_rel(doc)} names scripts or options that do not exist: {bad}"


# --- Python names ---------------------------------------------------------------------------

_DOTTED = re.compile(r"(?<![\w/.])hetps(?:\.[A-Za-z_]\w*)+(?![\w/])")


def name_problem(name: str) -> str | None:
    """``hetps.a.b.C``: the longest prefix that is a module of ``src/`` exists, and the next
    part is a name it defines (def, class, assignment, import, or a name of a lazy export)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath("src", *parts[:i])
        module = base.with_suffix(".py")
        if not module.exists():
            module = base / "__init__.py"
        if module.exists():
            break
    else:
        return f"{name}: no such module"
    if i == len(parts):
        return None
    attr, text = parts[i], module.read_text()
    if attr in ("__file__", "__name__", "__path__", "__doc__"):  # every module has these
        return None
    defined = (
        rf"^\s*(?:async def|def|class) {attr}\b|^\s*(?:self\.)?{attr}\s*(?::[^=\n]*)?=(?!=)"
        rf"|^(?:from\s+\S+\s+)?import\b.*\b{attr}\b|^\s+{attr},|\"{attr}\"[:,)]"
    )
    if re.search(defined, text, re.M):
        return None
    return f"{name}: {module.relative_to(ROOT)} defines no {attr}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_hetps_module_and_name_a_doc_names_exists(doc):
    names = set(_DOTTED.findall(doc.read_text()))
    bad = sorted(b for n in names if (b := name_problem(n)))
    assert not bad, f"{_rel(doc)} names modules or names hetps does not have: {bad}"


# --- variables --------------------------------------------------------------------------------


@cache
def source_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "src" / "hetps").rglob("*.py"))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_hetps_variable_a_doc_names_is_read_by_the_code(doc):
    names = set(re.findall(r"\bHETPS_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text()))
    bad = sorted(n for n in names if f'"{n}"' not in source_text())
    assert not bad, f"{_rel(doc)} names variables hetps does not read: {bad}"


# --- the checks themselves bite -----------------------------------------------------------------


def test_the_lines_taken_for_output_are_printed_by_hetps():
    code = source_text()
    for line, literal in PRINTED.items():
        assert literal in code, f"nothing prints {line!r} any more: drop it from PRINTED"
    assert 'f"hetps {args.cmd}: {exc}"' in code


def test_the_checks_find_what_is_missing():
    """Each check, fed a line naming something that does not exist, says so."""
    assert path_problem("docs/NOT_A_PAGE.md", None)
    assert path_problem("tests/unit/test_docs.py", "test_not_here")
    assert not path_problem("tests/unit/test_docs.py", "test_the_checks_find_what_is_missing")
    assert repo_paths("see `kvstore/server.py`") == [("src/hetps/kvstore/server.py", None)]
    assert hetps_problems("hetps trian -n 2")
    assert not hetps_problems("hetps train --servers 2 --replicas 2")
    assert hetps_problems("hetps scheduler --replicas 2")  # launch's and train's, not its own
    assert hetps_problems("hetps train --no-such-flag")
    assert not hetps_problems("hetps launch -n 2 --replicas 2 -- python x.py --replicas")
    assert hetps_problems("hetps netem --nodse 4")
    assert not hetps_problems("hetps netem show")
    assert not hetps_problems("hetps netem s.toml --nodes 4 -- python x.py --nodse")
    assert hetps_problems("hetps sumary runs")
    assert script_problems("python benchmarks/round_trip.py --rounds 5 --no-such-option")
    assert script_problems("python benchmarks/no_such_bench.py")
    assert section_problems('docs/BALANCE.md, "No such section"', ROOT)
    assert section_problems("docs/BALANCE.md §42", ROOT)
    assert not section_problems("docs/BALANCE.md §7.3", ROOT)
    assert name_problem("hetps.kvstore.nothing_here")
    assert name_problem("hetps.torch.NoTrainer")
    assert not name_problem("hetps.esync.ESyncTrainer")  # a lazy export
    assert not name_problem("hetps.roles.run_server")
    assert outside("see ../shared/peers/mxnet/bench_mx.py", ROOT / "docs" / "X.md")
    assert outside("--mx-python /work/main/mxpeer-venv/bin/python", ROOT / "README.md")
    assert outside("commit e8b95b5 on branch `pipeline`", ROOT / "README.md")
    assert not outside("[b](../benchmarks/README.md)", ROOT / "docs" / "X.md")


def test_what_the_readme_says_of_slow_tests_is_true():
    """The README's test command leaves out tests marked ``slow`` (a mark pyproject.toml
    declares), CI runs the same command, and the README says whether any test carries it."""
    readme = (ROOT / "README.md").read_text()
    command = '.venv/bin/python -m pytest -m "not slow"'
    assert command in readme
    assert command in (ROOT / ".ci" / "run").read_text()
    assert re.search(r'^\s*"slow: ', (ROOT / "pyproject.toml").read_text(), re.M)
    marked = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("*.py")
        if p.name != "test_docs.py" and re.search(r"mark\.slow\b|\"slow\"\)", p.read_text())
    )
    says_none = "no test carries the mark" in readme
    assert says_none == (not marked), (
        f"README.md says {'no' if says_none else 'some'} test is marked slow; marked: {marked}"
    )


def test_the_readme_says_what_update_on_worker_does_with_the_sum():
    # the default op is the mean: the README must not leave the reader with a plain sum
    import inspect

    from hetps.torch.optimizer import DistributedOptimizer

    default = inspect.signature(DistributedOptimizer).parameters["op"].default
    text = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r'`update_on="worker"` \(the default: (.*?)\), `update_on="server"`', text)
    assert said, "README no longer describes update_on='worker'"
    assert f'`op="{default}"`, the default' in said.group(1), said.group(1)
    assert "divides the sum by the number of workers" in said.group(1)
