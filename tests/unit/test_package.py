"""The package's conventional entry points: ``import hetps; hetps.kv.create(...)``."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_import_hetps_exposes_kv_and_optim_without_loading_torch():
    out = _run(
        "import sys, hetps\n"
        "assert 'torch' not in sys.modules and 'zmq' not in sys.modules\n"
        "kv = hetps.kv.create('local')\n"
        "import numpy as np\n"
        "kv.init(3, np.ones(2, np.float32))\n"
        "kv.set_optimizer(hetps.optim.SGD(learning_rate=0.5))\n"
        "kv.push(3, np.ones(2, np.float32))\n"
        "print(kv.pull(3).tolist(), hetps.sync.average([np.ones(1)]).tolist())\n"
        "print('torch' in sys.modules, sorted({'kv', 'optim', 'sync'} & set(dir(hetps))))\n"
    )
    assert out.splitlines() == ["[0.5, 0.5] [1.0]", "False ['kv', 'optim', 'sync']"]


def test_unknown_attribute_is_still_an_attribute_error():
    out = _run("import hetps\ntry:\n    hetps.nope\nexcept AttributeError as e:\n    print(e)\n")
    assert "no attribute 'nope'" in out
