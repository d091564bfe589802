"""ESync, as one wing: the readiness rule, the state service and the worker's trainer.

ESync (Li et al., "ESync: An Efficient Synchronous Parallel Algorithm for Distributed ML in
Heterogeneous Clusters") lets every device take local steps until the slowest has taken one;
then all push their model difference and the servers sum.

* :mod:`hetps.esync.policy`: :class:`ReadinessPolicy`, the pure rule (no I/O, no clock).
* :mod:`hetps.esync.service`: the state server around it (:class:`EsyncService` inside the
  scheduler, :class:`StateServer` standalone) and :class:`StateClient`, the worker's side.
* :mod:`hetps.esync.trainer`: :class:`ESyncTrainer`, the loop for your own PyTorch script.

The names load on first use, so the scheduler can use the rule without importing torch.
"""

from __future__ import annotations

from hetps import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {  # submodule -> the public names it defines
        "hetps.esync.policy": ("ReadinessPolicy", "WorkerState"),
        "hetps.esync.service": ("EsyncService", "StateServer", "StateClient"),
        "hetps.esync.trainer": ("ESyncTrainer", "ESyncRound"),
    },
    globals(),
)
