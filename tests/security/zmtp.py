"""A bare ZMTP 3.0 peer over a plain TCP socket, for what pyzmq will not send: a frame header
announcing more bytes than follow, or a handshake cut short. Only for tests."""

from __future__ import annotations

import socket
import struct


def greeting(mechanism: bytes = b"NULL") -> bytes:
    """The 64-byte ZMTP 3.0 greeting of a client."""
    return (
        b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x00" * 32
    )


def command(name: bytes, props: dict[bytes, bytes]) -> bytes:
    body = bytes([len(name)]) + name
    for k, v in props.items():
        body += bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
    if len(body) < 256:
        return bytes([0x04, len(body)]) + body
    return bytes([0x06]) + struct.pack(">Q", len(body)) + body


def frame_header(size: int, more: bool = False) -> bytes:
    """The header of one message frame announcing ``size`` bytes."""
    flags = 0x01 if more else 0x00
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | 0x02]) + struct.pack(">Q", size)


class Peer:
    """A DEALER speaking ZMTP 3.0 with the NULL mechanism, by hand."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)

    def handshake(self, routing_id: bytes = b"") -> bytes:
        """Greet and send READY; returns what the other side sent back (its greeting and
        READY, or less when it refuses the mechanism)."""
        self.sock.sendall(greeting())
        got = self._read(64)
        props = {b"Socket-Type": b"DEALER"}
        if routing_id:
            props[b"Identity"] = routing_id
        self.sock.sendall(command(b"READY", props))
        return got

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                break
            out += chunk
        return out

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self) -> bool:
        """Whether the other side has closed the connection (reads to EOF or a reset)."""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()
