"""Network-aware server load distribution: pure algorithms, numbers in and numbers out.
(docs/MODULES.md, "hetps.balance")"""

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
