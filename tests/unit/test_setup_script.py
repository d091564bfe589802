"""scripts/setup.sh: the main job's setup installs what the job needs, ``--tests`` adds what
the tests need, and a site's own Slurm or Prometheus is never replaced (``--dry-run`` says
what each would install). README's quick start and CI use the two commands."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(tmp_path: Path, *args: str, site: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """Run a copy of the script with a PATH of only the tools it calls and ``site``'s fake
    commands; (the extras pip would install, the packages apt would)."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "id"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name in site:
        fake = bin_dir / name
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    res = subprocess.run(
        [shutil.which("bash"), str(tmp_path / "scripts" / "setup.sh"), *args, "--dry-run"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": str(bin_dir)},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    extras = re.search(r"would pip install -e \.\[(.*)\]", res.stdout).group(1)
    apt = re.search(r"would apt-get install: (.*)", res.stdout).group(1).split()
    return extras, [] if apt == ["nothing"] else apt


def test_the_main_setup_installs_the_job_not_the_tests(tmp_path):
    extras, apt = _dry_run(tmp_path)
    assert extras.split(",") == ["torch", "plots", "metrics"]
    assert apt == []  # no browser, no Slurm daemons, no Prometheus on a user's node


def test_the_tests_setup_adds_theirs_and_leaves_a_sites_slurm_and_prometheus(tmp_path):
    extras, apt = _dry_run(tmp_path, "--tests")
    assert {"lightning", "dev", "ray", "k8s", "tensorboard"} <= set(extras.split(","))
    for pkg in ("iproute2", "slurm-wlm", "munge", "prometheus", "chromium", "chromium-driver"):
        assert pkg in apt
    for site in (("sinfo",), ("srun",), ("slurmd",)):
        _, apt = _dry_run(tmp_path, "--tests", site=(*site, "prometheus"))
        assert not {"slurm-wlm", "munge", "prometheus"} & set(apt), (site, apt)
        assert "chromium" in apt


def test_the_readme_and_ci_use_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [x.strip() for x in quick.splitlines() if x.startswith("    bash ")]
    assert commands == [
        "bash scripts/setup.sh && .venv/bin/hetps launch -n 2 -s 1 -- .venv/bin/python "
        "examples/linear_regression.py",
        'bash scripts/setup.sh --tests && .venv/bin/python -m pytest -m "not slow"',
    ]
    assert (
        "bash scripts/setup.sh --tests && .venv/bin/python -m pytest"
        in (ROOT / ".ci" / "run").read_text()
    )
