"""Network-aware server load distribution: pure algorithms, numbers in and numbers out.

- :mod:`.network` -- the link model (:class:`Network`), the affine load model of a plan
  (:class:`LoadModel`) and predicted times (:func:`iteration_time`, :func:`server_times`).
- :mod:`.estimate` -- forecast-then-probe samples and per-link smoothed estimates.
- :mod:`.plans` -- the plans by name (:data:`PLANS`, ``@plan``): ``average``, ``elastic``,
  ``aware``, ``optimal``; :func:`make_plan`.
- :mod:`.solve` -- the exact min-max solvers and :func:`lower_bound`.
- :mod:`.slicing` -- slice layout, Algorithm 2 (:func:`assign`) and the slice-size model.

docs/BALANCE.md derives the model and the algorithms.
"""

from hetps.config.table import use_plan_registry

from .estimate import EstimateTable, ForecastMatcher, Sample, sample_rate
from .network import (
    LoadModel,
    Network,
    iteration_time,
    resolve_roles,
    server_times,
)
from .plans import (
    PLAN_NAMES,
    PLANS,
    average_plan,
    aware_plan,
    elastic_plan,
    equalise_linear,
    fit_linear,
    make_plan,
    optimal_plan,
)
from .slicing import (
    Slice,
    assign,
    choose_slice_size,
    fit_granularity,
    granularity_cost,
    layout,
)
from .solve import greedy_round, largest_remainder, lower_bound, solve_continuous, solve_integer

use_plan_registry(lambda: tuple(PLANS))  # HETPS_BALANCE's choices (config imports no balance)

__all__ = [
    "PLANS",
    "PLAN_NAMES",
    "EstimateTable",
    "ForecastMatcher",
    "LoadModel",
    "Network",
    "Sample",
    "Slice",
    "assign",
    "average_plan",
    "aware_plan",
    "choose_slice_size",
    "elastic_plan",
    "equalise_linear",
    "fit_granularity",
    "fit_linear",
    "granularity_cost",
    "greedy_round",
    "iteration_time",
    "largest_remainder",
    "layout",
    "lower_bound",
    "make_plan",
    "optimal_plan",
    "resolve_roles",
    "sample_rate",
    "server_times",
    "solve_continuous",
    "solve_integer",
]
