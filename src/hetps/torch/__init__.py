"""PyTorch integration: ``DistributedOptimizer`` and broadcast helpers (ESync's loop is
:class:`hetps.esync.ESyncTrainer`; the ``hetps train`` app that uses them is :mod:`hetps.app`).

Horovod/BytePS style::

    import hetps.kv, hetps.torch as hps

    kv = hetps.kv.create("dist_sync")
    opt = hps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), kvstore=kv)
    hps.broadcast_parameters(model.state_dict(), kv, root_rank=0)
    hps.broadcast_optimizer_state(opt, kv, root_rank=0)
    hps.log_metrics(loss=loss, accuracy=acc)   # shown per worker on the live dashboard

The names load on first use, so importing ``hetps.torch`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the submodule that defines it
_EXPORTS = {
    "DistributedOptimizer": "hetps.torch.optimizer",
    "broadcast_parameters": "hetps.torch.broadcast",
    "broadcast_optimizer_state": "hetps.torch.broadcast",
    "log_metrics": "hetps.torch.live",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hetps.torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
