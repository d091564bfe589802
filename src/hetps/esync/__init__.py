"""ESync, as one wing: the readiness rule, the state service and the worker's trainer.
(docs/MODULES.md, "hetps.esync")"""

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
