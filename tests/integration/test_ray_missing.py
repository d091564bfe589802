"""Without Ray installed, `hetps launch --launcher ray` says how to install it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_without_ray_the_launcher_says_how_to_install_it():
    """No ray module: one line naming the extra. (No cluster needed.)"""
    code = textwrap.dedent("""
        import sys
        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("no ray here")
        sys.meta_path.insert(0, NoRay())
        from hetps.cli import main
        sys.exit(main(["launch", "--launcher", "ray", "-n", "1", "--", "true"]))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'hetps[ray]'" in lines[0], res.stderr
