"""hetps: a parameter server for PyTorch on heterogeneous clusters.
(docs/MODULES.md, "hetps.__init__")"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"

#: submodules reachable as ``hetps.<name>`` after a plain ``import hetps`` (loaded lazily)
_LAZY = ("kv", "optim", "sync")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"hetps.{name}")  # also sets it as our attribute
    raise AttributeError(f"module 'hetps' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def lazy_exports(
    package: str, exports: dict[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__all__``, ``__getattr__`` and ``__dir__`` for ``exports`` (defining
    submodule -> its public names): each name loads on first use and is kept in ``namespace``
    (the package's globals)."""
    where = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value  # later lookups find it in the namespace

    return sorted(where), getattr_, lambda: sorted({*namespace, *where})
