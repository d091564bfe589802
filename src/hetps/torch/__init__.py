"""PyTorch integration: ``DistributedOptimizer``, the broadcast helpers and Horovod's and
BytePS's API (``import hetps.torch as hvd``; README.md, "Training (PyTorch, Fashion-MNIST)").

The names load on first use, so importing ``hetps.torch`` does not import torch."""

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
