"""The port through which a part reaches its process's peers: :class:`PeerLinks`.

A part (a node's registration and recovery, the scheduler's registration and takeover,
ESync's state client) gets this port from the composition root or from its host, never the
host's :class:`~hetps.transport.van.Van` by reaching through it (as ps-lite's Customer gets a
handle, not the Postoffice). A Van is one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from hetps.transport.codec import Message
from hetps.transport.security import HandshakeWatch


class PeerLinks(Protocol):
    """Connections to peers, each named by a node id (or, before registration, by the
    routing id it came on): open, name, send on, close, mark dead and alive again."""

    #: this process's node id once the scheduler gave it (0 before)
    my_id: int

    #: the port this process receives on
    @property
    def port(self) -> int: ...
    #: ``host:port`` this process receives on
    @property
    def endpoint(self) -> str: ...
    #: open a connection to ``endpoint`` named ``peer``; returns its routing id
    def connect(
        self,
        peer: Any,
        endpoint: str,
        routing_id: bytes | None = None,
        watch: bool = False,
        bulk: bool = False,
    ) -> bytes: ...
    #: close the connection to ``peer``
    def disconnect(self, peer: Any, linger_ms: int = 0) -> None: ...
    #: messages that come on ``routing_id`` read as sent by ``node_id``
    def admit(self, routing_id: bytes, node_id: int) -> None: ...
    #: the connection named ``old`` is named ``new`` from now on
    def rename(self, old: Any, new: Any) -> None: ...
    #: the node a routing id was admitted as
    def node_of(self, routing_id: bytes) -> int: ...
    #: the watch of the handshakes of a connection opened with ``watch=True``
    def take_watch(self, peer: Any) -> HandshakeWatch | None: ...
    #: ``peer`` died: sends to it fail at once instead of queueing
    def mark_dead(self, peer: Any) -> None: ...
    #: ``peer`` is alive again (it came back)
    def revive(self, peer: Any) -> None: ...
    #: send ``msg`` to ``peer`` (raises :class:`~hetps.transport.van.PeerGone`)
    def send(
        self,
        peer: Any,
        msg: Message,
        track: bool = False,
        give_up: Callable[[], str | None] | None = None,
    ) -> Any: ...
