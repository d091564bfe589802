"""Optimizers by name, as MXNet's ``mx.optimizer.create('sgd', ...)`` looks them up.
(docs/MODULES.md, "hetps.optim.registry")"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hetps.config.table import use_optimizer_registry
from hetps.optim.base import Optimizer

__all__ = ["create", "optimizer", "register", "registered", "registered_names"]

_OptimizerT = TypeVar("_OptimizerT", bound=type[Optimizer])

#: name -> class, in the order they were registered (the built-ins: sgd, adam, adagrad, dcasgd)
_REGISTRY: dict[str, type[Optimizer]] = {}


def registered_names() -> list[str]:
    """The names :func:`create` accepts, sorted."""
    return sorted(_REGISTRY)


def registered() -> dict[str, type[Optimizer]]:
    """Name -> class, in the order they were registered."""
    return dict(_REGISTRY)


def register(klass: _OptimizerT, name: str | None = None) -> _OptimizerT:
    """Register an :class:`Optimizer` subclass under ``name`` (default: its class name).

    Names are case-insensitive. A class registered in an importable module is one a server
    with ``HETPS_OPTIMIZERS`` set to names takes by name; one of a worker's ``__main__`` is
    known to that worker's :func:`create` only.

    Raises:
        TypeError: ``klass`` is not an Optimizer subclass.
        ValueError: the name is already taken by another class.
    """
    if not (isinstance(klass, type) and issubclass(klass, Optimizer)):
        raise TypeError(f"can only register Optimizer subclasses, got {klass!r}")
    key = (name or klass.__name__).lower()
    existing = _REGISTRY.get(key)
    if existing is not None and existing is not klass:
        raise ValueError(
            f"optimizer name {key!r} is already registered to {existing.__qualname__}; "
            "pass another name to register()"
        )
    _REGISTRY[key] = klass
    return klass


def optimizer(name: str) -> Callable[[_OptimizerT], _OptimizerT]:
    """``@optimizer("name")``: the class decorator that registers an optimizer by ``name``."""
    return lambda klass: register(klass, name)


def create(name: str, **kwargs: Any) -> Optimizer:
    """Create an optimizer by (case-insensitive) name: ``'sgd'``, ``'adam'``, ``'dcasgd'``...

    Keyword arguments go to the optimizer's constructor.

    Raises:
        ValueError: ``name`` is not a registered optimizer; the message lists the known ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"optimizer name must be a str, got {type(name).__name__}")
    klass = _REGISTRY.get(name.lower())
    if klass is None:
        raise ValueError(
            f"unknown optimizer {name!r}; known optimizers: {', '.join(registered_names())} "
            "(or pass an Optimizer instance / register() your own class)"
        )
    return klass(**kwargs)


use_optimizer_registry(registered_names)  # HETPS_OPTIMIZERS' names (config imports no optim)
