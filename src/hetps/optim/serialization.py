"""Ship optimizers to servers by value, and save/load optimizer states.
(docs/MODULES.md, "hetps.optim.serialization")"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Collection
from typing import Any

import cloudpickle

from hetps.optim.base import Optimizer
from hetps.optim.registry import registered, registered_names
from hetps.optim.sums import SumKeys

__all__ = ["dump_states", "dumps", "load_states", "loads"]

_STATES_FORMAT = "hetps-optimizer-states"
_STATES_VERSION = 1


def _check_bytes(data: Any, what: str) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} expects bytes, got {type(data).__name__}")
    return bytes(data)


def dumps(optimizer: Optimizer) -> bytes:
    """Serialise ``optimizer`` (its class too, when defined in ``__main__``) with cloudpickle.

    A class defined in an importable module is pickled by reference, so that module must be
    importable on the servers; otherwise call ``cloudpickle.register_pickle_by_value(module)``
    before :func:`dumps`.

    Raises:
        TypeError: ``optimizer`` is not an :class:`Optimizer`.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"dumps() expects a hetps.optim.Optimizer, got {type(optimizer).__name__}; "
            "subclass hetps.optim.Optimizer and implement create_state() and update()"
        )
    return cloudpickle.dumps(optimizer, protocol=pickle.HIGHEST_PROTOCOL)


#: what a state map's pickle may build under HETPS_OPTIMIZERS=names: NumPy arrays, their
#: dtypes and scalars (NumPy 1 and 2 module names), besides plain containers and numbers
_STATE_GLOBALS = {
    (f"numpy.{core}.{mod}", name)
    for core in ("core", "_core")
    for mod, name in (
        ("numeric", "_frombuffer"),
        ("multiarray", "_reconstruct"),
        ("multiarray", "scalar"),
    )
} | {("numpy", "dtype"), ("numpy", "ndarray")}


#: hetps' own wrappers of an optimizer, taken under any list (what they wrap is checked too)
_WRAPPERS = {(SumKeys.__module__, SumKeys.__qualname__)}


def _class_by_value(data: bytes) -> str:
    """The module and name of the class a cloudpickle builds by value (read from its
    opcodes, nothing run), or "" where the pickle does not say."""
    try:
        strings = [a for _, a, _ in pickletools.genops(data) if isinstance(a, str)]
        at = strings.index("_make_skeleton_class") + 3  # then builtins.type, then the name
        module = strings[strings.index("__module__", at) + 1]
        return f"{module}.{strings[at]}"
    except (ValueError, IndexError):  # not a class by value, or a pickle cut short
        return ""


class _Registered(pickle.Unpickler):
    """An unpickler that builds only the registered optimizers ``names`` (by reference; the
    name ``registered`` stands for every one), or with ``states`` a state map's NumPy
    arrays: a class pickled by value, or any other global, is refused before any of it runs."""

    def __init__(self, data: bytes, names: Collection[str], states: bool = False) -> None:
        super().__init__(io.BytesIO(data))
        self.data, self.states = data, states
        every = "registered" in names
        self.names = registered_names() if every else sorted(names)
        self.classes = (
            _STATE_GLOBALS
            if states
            else _WRAPPERS
            | {(c.__module__, c.__qualname__) for n, c in registered().items() if n in self.names}
        )
        self.setting = "HETPS_OPTIMIZERS=registered, the default" if every else "HETPS_OPTIMIZERS"

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.classes:
            return super().find_class(module, name)
        cls = _class_by_value(self.data) if module.startswith("cloudpickle") else ""
        by_value = " (a class pickled by value)" if module.startswith("cloudpickle") else ""
        what, fix = (
            ("optimizer states'", "states hold NumPy arrays and numbers only here")
            if self.states
            else (
                "optimizer's",
                'register its class with @optimizer("name") in a module the servers import'
                + ("" if self.setting != "HETPS_OPTIMIZERS" else " and add that name to it"),
            )
        )
        raise PermissionError(
            f"{cls + ' is refused: ' if cls else ''}the {what} pickle names "
            f"{module}.{name}{by_value}, and this server takes only "
            f"{', '.join(self.names)} ({self.setting}): {fix}, or set HETPS_OPTIMIZERS=any "
            "on the servers (unpickling then runs the worker's code)"
        )


def loads(data: bytes, allowed: Collection[str] | None = None) -> Optimizer:
    """Rebuild an optimizer serialised by :func:`dumps`: any one, or with ``allowed`` (names
    of the registry, as ``HETPS_OPTIMIZERS`` lists them) only those classes, by reference.

    Raises:
        TypeError: ``data`` is not bytes, or does not hold a :class:`Optimizer`.
        PermissionError: ``allowed`` does not take the pickled class; the message says how.
        ValueError: ``data`` cannot be unpickled (corrupt, or it refers to a module this
            process cannot import); the message says which.
    """
    data = _check_bytes(data, "loads()")
    try:
        obj = pickle.loads(data) if allowed is None else _Registered(data, allowed).load()
    except PermissionError:
        raise
    except (ModuleNotFoundError, AttributeError) as exc:
        raise ValueError(
            f"cannot rebuild the optimizer: {exc}. Its class is pickled by reference; install "
            "its module on the servers, or call cloudpickle.register_pickle_by_value(module) "
            "on the worker before set_optimizer()"
        ) from exc
    except Exception as exc:
        raise ValueError(
            f"cannot unpickle the optimizer ({type(exc).__name__}: {exc}); "
            "the bytes were not produced by hetps.optim.dumps() or are corrupt"
        ) from exc
    if not isinstance(obj, Optimizer):
        raise TypeError(
            f"the pickled object is a {type(obj).__name__}, not a hetps.optim.Optimizer; "
            "only Optimizer subclasses can be set as the server-side optimizer"
        )
    return obj


def dump_states(states: dict[Any, Any]) -> bytes:
    """Serialise a server's optimizer states (``{key: state}``; keys may be tuples).

    States are NumPy arrays, numbers and dicts/tuples of them; cloudpickle is used so that
    states of a user-defined optimizer holding its own objects are saved too.

    Raises:
        TypeError: ``states`` is not a dict.
    """
    if not isinstance(states, dict):
        raise TypeError(f"dump_states() expects a dict of states, got {type(states).__name__}")
    payload = {"format": _STATES_FORMAT, "version": _STATES_VERSION, "states": states}
    return cloudpickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


def load_states(data: bytes, allowed: Collection[str] | None = None) -> dict[Any, Any]:
    """Rebuild the states dict written by :func:`dump_states`: any, or with ``allowed`` (a
    server's ``HETPS_OPTIMIZERS`` names) only NumPy arrays, numbers and containers.

    Raises:
        TypeError: ``data`` is not bytes.
        PermissionError: with ``allowed``, the pickle names another global (nothing ran).
        ValueError: ``data`` is corrupt or was not written by :func:`dump_states` (for
            example an MXNet ``.states`` file, which holds MXNet NDArrays).
    """
    data = _check_bytes(data, "load_states()")
    try:
        payload = pickle.loads(data) if allowed is None else _Registered(data, allowed, True).load()
    except PermissionError:
        raise
    except Exception as exc:
        raise ValueError(
            f"cannot unpickle optimizer states ({type(exc).__name__}: {exc}); "
            "the file is corrupt or was not written by save_optimizer_states()"
        ) from exc
    if not (
        isinstance(payload, dict)
        and payload.get("format") == _STATES_FORMAT
        and isinstance(payload.get("states"), dict)
    ):
        raise ValueError(
            "these bytes are not hetps optimizer states (written by dump_states() / "
            "save_optimizer_states()); MXNet .states files cannot be loaded"
        )
    if payload.get("version") != _STATES_VERSION:
        raise ValueError(
            f"optimizer states format version {payload.get('version')!r} is not supported "
            f"(this hetps reads version {_STATES_VERSION})"
        )
    return payload["states"]
