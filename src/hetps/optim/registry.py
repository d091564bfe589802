"""Look optimizers up by name, as MXNet's ``mx.optimizer.create('sgd', ...)`` does."""

from __future__ import annotations

from typing import Any, TypeVar

from hetps.optim.adagrad import AdaGrad
from hetps.optim.adam import Adam
from hetps.optim.base import Optimizer
from hetps.optim.dcasgd import DCASGD
from hetps.optim.sgd import SGD

__all__ = ["create", "register", "registered_names"]

_OptimizerT = TypeVar("_OptimizerT", bound=type[Optimizer])

_REGISTRY: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adagrad": AdaGrad,
    "dcasgd": DCASGD,
}


def registered_names() -> list[str]:
    """The names :func:`create` accepts, sorted."""
    return sorted(_REGISTRY)


def register(klass: _OptimizerT, name: str | None = None) -> _OptimizerT:
    """Register an :class:`Optimizer` subclass under ``name`` (default: its class name).

    Names are case-insensitive. Usable as a decorator. Registering only affects
    :func:`create` in this process; optimizers reach servers by value, not by name.

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
