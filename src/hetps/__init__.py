"""hetps: a parameter server for PyTorch on heterogeneous clusters.

``hetps.kv.create(name)`` gives MXNet's KVStore API over NumPy arrays and CPU torch tensors.
"""

__version__ = "0.1.0"
