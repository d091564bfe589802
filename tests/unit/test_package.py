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


def test_hetps_torch_exports_the_horovod_style_api_and_its_cli_flags_need_no_torch():
    out = _run(
        "import sys\n"
        "import hetps.app.train, hetps.cli\n"
        "hetps.cli.build_parser()\n"
        "print('torch' in sys.modules)\n"
        "import hetps.torch as hps\n"
        "from hetps.torch.optimizer import DistributedOptimizer\n"
        "from hetps.torch.broadcasting import broadcast_parameters, broadcast_optimizer_state\n"
        "from hetps.esync.trainer import ESyncTrainer\n"
        "print(issubclass(hps.DistributedOptimizer, DistributedOptimizer),\n"
        "      hps.broadcast_parameters is broadcast_parameters,\n"
        "      hps.broadcast_optimizer_state is broadcast_optimizer_state,\n"
        "      'ESyncTrainer' in dir(hps), sorted(hps.__all__))\n"
        "import hetps.esync as esync\n"
        "print(esync.ESyncTrainer is ESyncTrainer, sorted(esync.__all__))\n"
    )
    assert out.splitlines() == [
        "False",
        "True True True False ['Adasum', 'Average', 'Compression', 'DistributedOptimizer', "
        "'Sum', 'SyncBatchNorm', 'allgather', 'allreduce', 'allreduce_', 'allreduce_async', "
        "'broadcast', 'broadcast_', 'broadcast_object', 'broadcast_optimizer_state', "
        "'broadcast_parameters', 'init', 'is_initialized', 'local_rank', 'local_size', 'log_metrics', "
        "'poll', 'push_pull', 'push_pull_async', 'push_pull_inplace', 'rank', 'shutdown', 'size', "
        "'synchronize']",
        "True ['ESyncRound', 'ESyncTrainer', 'EsyncService', 'ReadinessPolicy', 'StateClient', "
        "'StateServer', 'WorkerState']",
    ]
