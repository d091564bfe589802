"""The ports of the KVStore's hosts: what a part may use of the worker's store or of the
server it belongs to, named here once, so that a part takes its port and not the whole host.
(docs/MODULES.md, "hetps.kvstore.ports")"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol

from hetps import optim
from hetps.cluster.node import Node
from hetps.kvstore.aggregate import Aggregator
from hetps.kvstore.answers import Answers
from hetps.kvstore.compression import TwoBitCompressor
from hetps.kvstore.keys import KeyMeta
from hetps.kvstore.linkmeter import LinkMeter
from hetps.kvstore.placement import Part
from hetps.kvstore.slices import Slice
from hetps.tables.server import Tables
from hetps.tables.worker import SparseKeys, TableStore
from hetps.transport.codec import Message

if TYPE_CHECKING:
    from hetps.balance.agent import BalanceAgent


class Rejoin(Protocol):
    """A store's joining part (hetps.faults.joining) as its host aggregation reads it."""

    @property
    def rejoining(self) -> bool: ...


class StorePort(TableStore, Protocol):
    """What a worker store's parts use of it: what its tables use (its Node, mode, keys and
    way to the servers), the keys' rounds, and where a key's parts go."""

    meta: dict[Hashable, KeyMeta]
    compressor: TwoBitCompressor | None
    #: the servers' node ids by rank
    server_ids: list[int]
    #: push calls so far; whether a push carries its round (HETPS_REPLICAS)
    calls: int
    copies: bool
    #: per key, the ranges last received as a sum of fewer workers than the job's
    short_marks: dict[Hashable, dict[tuple[int, int], int]]
    #: the balance agent (HETPS_BALANCE), the row-sparse keys, its joining part
    agent: BalanceAgent | None
    sparse: SparseKeys
    joins: Rejoin

    #: this worker's place among the live workers
    @property
    def live_rank(self) -> int: ...
    #: where the parts of a new key go
    def placement(self, key: Any, size: int) -> list[Part]: ...
    #: wait for every request in flight
    def wait_outstanding(self) -> None: ...


class ServerPort(Protocol):
    """What a server's fault parts use of it: its Node, slices, answers, aggregator,
    optimizer and tables, and its way to end a round."""

    node: Node
    slices: dict[tuple[Hashable, int], Slice]
    answers: Answers
    aggregator: Aggregator
    links: LinkMeter
    tables: Tables
    optimizer: optim.Optimizer | None
    #: the optimizer as a worker sent it (for a new replica)
    optimizer_blob: bytes | None
    rounds: int

    #: the workers a round waits for
    @property
    def num_workers(self) -> int: ...
    #: whether the worker count was set by hand (no worker leaves or joins)
    @property
    def workers_fixed(self) -> bool: ...
    #: handle an ``init`` request
    def init(self, msg: Message) -> None: ...
    #: a slice's round is complete: merge, update, answer
    def finish_round(self, sl: Slice) -> None: ...
    #: acknowledge a push that took effect
    def ack(self, msg: Message, sl: Slice) -> None: ...
