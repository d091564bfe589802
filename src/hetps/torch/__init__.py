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

# fmt: off
__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {  # submodule -> the public names it defines
        "hetps.torch.horovod": ("DistributedOptimizer",),
        "hetps.torch.broadcasting": ("broadcast_parameters", "broadcast_optimizer_state"),
        "hetps.torch.syncbn": ("SyncBatchNorm",),
        "hetps.torch.live": ("log_metrics",),
        # the process's store (Horovod's hvd.init() and friends)
        "hetps.torch.process": (
            "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size"),
        # collectives through the servers
        "hetps.torch.collectives": (
            "Average", "Sum", "Adasum", "Compression", "allreduce", "allreduce_",
            "allreduce_async", "synchronize", "poll", "allgather", "broadcast", "broadcast_",
            "broadcast_object", "push_pull", "push_pull_async", "push_pull_inplace"),
    },
    globals(),
)
# fmt: on
