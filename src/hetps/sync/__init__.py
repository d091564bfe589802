"""Training algorithms' rules as pure functions: SSGD/ASGD/DC-ASGD/ESync updates. The loops
that drive them live in ``hetps.torch`` and ``hetps.esync`` (with ESync's readiness rule);
nothing here does I/O or reads a clock."""

from hetps.sync import rules
from hetps.sync.rules import *  # noqa: F403 - the rules named in rules.__all__

__all__ = rules.__all__
