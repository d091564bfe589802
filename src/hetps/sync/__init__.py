"""Training algorithms' rules as pure functions: SSGD/ASGD/DC-ASGD/ESync updates. The loops
that drive them live in ``hetps.torch`` and ``hetps.esync`` (with ESync's readiness rule);
nothing here does I/O or reads a clock."""

from hetps.sync.rules import (
    average,
    average_from_sum,
    dcasgd_compensate,
    dcasgd_step,
    esync_global_update,
    esync_update_from_sum,
    model_delta,
    sgd_step,
    ssgd_step,
    sum_arrays,
)

__all__ = [
    "average",
    "average_from_sum",
    "dcasgd_compensate",
    "dcasgd_step",
    "esync_global_update",
    "esync_update_from_sum",
    "model_delta",
    "sgd_step",
    "ssgd_step",
    "sum_arrays",
]
