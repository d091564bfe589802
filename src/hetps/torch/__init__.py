"""PyTorch integration: ``DistributedOptimizer`` and broadcast helpers (ESync's loop is
:class:`hetps.esync.ESyncTrainer`; the ``hetps train`` app that uses them is :mod:`hetps.app`).

Horovod's and BytePS's API, with one changed import (``import hetps.torch as hvd``)::

    hvd.init()                       # dist_sync under hetps launch; a local store alone
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    avg = hvd.allreduce(torch.tensor(loss), name="avg_loss")

hetps's explicit form, with a store of one's own::

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

from hetps import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "DistributedOptimizer": "hetps.torch.horovod",
    "broadcast_parameters": "hetps.torch.broadcasting",
    "broadcast_optimizer_state": "hetps.torch.broadcasting",
    "SyncBatchNorm": "hetps.torch.syncbn",
    "log_metrics": "hetps.torch.live",
    # the process's store (Horovod's hvd.init() and friends)
    "init": "hetps.torch.process",
    "shutdown": "hetps.torch.process",
    "is_initialized": "hetps.torch.process",
    "rank": "hetps.torch.process",
    "size": "hetps.torch.process",
    "local_rank": "hetps.torch.process",
    "local_size": "hetps.torch.process",
    # collectives through the servers
    "Average": "hetps.torch.collectives",
    "Sum": "hetps.torch.collectives",
    "Adasum": "hetps.torch.collectives",
    "Compression": "hetps.torch.collectives",
    "allreduce": "hetps.torch.collectives",
    "allreduce_": "hetps.torch.collectives",
    "allreduce_async": "hetps.torch.collectives",
    "synchronize": "hetps.torch.collectives",
    "poll": "hetps.torch.collectives",
    "allgather": "hetps.torch.collectives",
    "broadcast": "hetps.torch.collectives",
    "broadcast_": "hetps.torch.collectives",
    "broadcast_object": "hetps.torch.collectives",
    "push_pull": "hetps.torch.collectives",
    "push_pull_async": "hetps.torch.collectives",
    "push_pull_inplace": "hetps.torch.collectives",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
