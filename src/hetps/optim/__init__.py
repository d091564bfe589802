"""Server-side optimizers: SGD, Adam, AdaGrad and DC-ASGD behind one small contract.

Subclass :class:`Optimizer`, implement ``create_state(key, weight)`` and
``update(key, weight, grad, state)`` (updating the NumPy ``weight`` in place), and hand an
instance to ``kv.set_optimizer()``; it travels to the servers by value (:func:`dumps`).

Pure NumPy; imports no other hetps layer.
"""

from hetps.optim.adagrad import AdaGrad
from hetps.optim.adam import Adam
from hetps.optim.base import Key, Optimizer, compute_dtype
from hetps.optim.dcasgd import DCASGD
from hetps.optim.registry import create, register, registered_names
from hetps.optim.serialization import dump_states, dumps, load_states, loads
from hetps.optim.sgd import SGD

__all__ = [
    "DCASGD",
    "SGD",
    "AdaGrad",
    "Adam",
    "Key",
    "Optimizer",
    "compute_dtype",
    "create",
    "dump_states",
    "dumps",
    "load_states",
    "loads",
    "register",
    "registered_names",
]
