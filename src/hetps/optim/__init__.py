"""Server-side optimizers: SGD, Adam, AdaGrad and DC-ASGD behind one small contract.
(docs/MODULES.md, "hetps.optim")"""

# the built-ins register themselves (@optimizer) in this order: the order they are offered in
from hetps.optim.sgd import SGD  # isort: skip
from hetps.optim.adam import Adam  # isort: skip
from hetps.optim.adagrad import AdaGrad  # isort: skip
from hetps.optim.dcasgd import DCASGD  # isort: skip
from hetps.optim.base import Key, Optimizer, compute_dtype
from hetps.optim.registry import create, optimizer, register, registered, registered_names
from hetps.optim.serialization import dump_states, dumps, load_states, loads

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
    "optimizer",
    "register",
    "registered",
    "registered_names",
]
