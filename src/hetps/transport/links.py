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

    @property
    def port(self) -> int:
        """The port this process receives on."""
        ...

    @property
    def endpoint(self) -> str:
        """``host:port`` this process receives on."""
        ...

    def connect(
        self,
        peer: Any,
        endpoint: str,
        routing_id: bytes | None = None,
        watch: bool = False,
        bulk: bool = False,
    ) -> bytes:
        """Open a connection to ``endpoint`` named ``peer``; returns its routing id."""
        ...

    def disconnect(self, peer: Any, linger_ms: int = 0) -> None:
        """Close the connection to ``peer``."""
        ...

    def admit(self, routing_id: bytes, node_id: int) -> None:
        """Messages that come on ``routing_id`` read as sent by ``node_id``."""
        ...

    def rename(self, old: Any, new: Any) -> None:
        """The connection named ``old`` is named ``new`` from now on."""
        ...

    def node_of(self, routing_id: bytes) -> int:
        """The node a routing id was admitted as."""
        ...

    def take_watch(self, peer: Any) -> HandshakeWatch | None:
        """The watch of the handshakes of a connection opened with ``watch=True``."""
        ...

    def mark_dead(self, peer: Any) -> None:
        """``peer`` died: sends to it fail at once instead of queueing."""
        ...

    def revive(self, peer: Any) -> None:
        """``peer`` is alive again (it came back)."""
        ...

    def send(
        self,
        peer: Any,
        msg: Message,
        track: bool = False,
        give_up: Callable[[], str | None] | None = None,
    ) -> Any:
        """Send ``msg`` to ``peer`` (raises :class:`~hetps.transport.van.PeerGone`)."""
        ...
