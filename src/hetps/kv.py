"""``hetps.kv``: MXNet-style entry point (``hetps.kv.create('dist_sync')``)."""

from hetps.kvstore import NAMES, DistKVStore, LocalKVStore, create

__all__ = ["NAMES", "DistKVStore", "LocalKVStore", "create"]
