"""The endpoint's HTTP server: one event loop in one thread of the scheduler, however many
connections are open; a connection costs a socket, never a thread (docs/LIVE.md,
"The endpoint's HTTP server")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("hetps.metrics.dashboard")

__all__ = ["MAX_CONNECTIONS", "MAX_HEAD", "REQUEST_TIMEOUT_S", "HttpServer"]

#: connections open at once; one more closes the oldest that has sent no whole request yet
MAX_CONNECTIONS = 256
#: seconds a connection has to send its request (and to take the answer)
REQUEST_TIMEOUT_S = 10.0
#: the request line and headers, at most
MAX_HEAD = 8192
#: threads that compute answers
ANSWER_THREADS = 4

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 500: "Internal Server Error"}  # fmt: skip

#: ``answer(method, path)`` -> (status, body, content type, extra headers)
Answer = Callable[[str, str], tuple[int, bytes, str, dict]]


class HttpServer:
    """Serve ``answer`` on ``port`` of every address in ``hosts`` (the first picks the port
    when it is 0; the others bind the same one). :attr:`port` is the port bound."""

    def __init__(self, hosts: list[str], port: int, answer: Answer) -> None:
        self.answer = answer
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(ANSWER_THREADS, thread_name_prefix="hetps-http")
        self._servers: list[asyncio.AbstractServer] = []
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # no whole request yet, oldest first
        self._open: set[asyncio.StreamWriter] = set()
        self.evicted = 0  # connections closed to make room
        try:
            for host in hosts:
                sock = _bind(host, port)
                port = sock.getsockname()[1]
                self._servers.append(
                    self._loop.run_until_complete(
                        asyncio.start_server(self._serve, sock=sock, limit=MAX_HEAD)
                    )
                )
        except BaseException:
            self._close_servers()
            self._loop.close()
            self._pool.shutdown(wait=False)
            raise
        self.port = port
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="hetps-dashboard", daemon=True
        )
        self._thread.start()

    # -- one connection -----------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._make_room()
        self._open.add(writer)
        self._waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except (asyncio.LimitOverrunError, ValueError):
                self._waiting.pop(writer, None)
                await self._write(writer, "GET", 431, b"request head too large\n", "text/plain")
                return
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
                return
            self._waiting.pop(writer, None)
            parts = head.split(b"\r\n", 1)[0].split(b" ")
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
                await self._write(writer, "GET", 400, b"bad request line\n", "text/plain")
                return
            method, path = parts[0].decode("latin-1"), parts[1].decode("latin-1")
            if method not in ("GET", "HEAD"):
                await self._write(writer, "GET", 405, b"GET or HEAD only\n", "text/plain",
                                  {"Allow": "GET, HEAD"})  # fmt: skip
                return
            loop = asyncio.get_running_loop()
            try:
                code, body, ctype, extra = await loop.run_in_executor(
                    self._pool, self.answer, method, path
                )
            except Exception as exc:  # noqa: BLE001 - one bad answer never stops the server
                log.warning("metrics: answering %s failed: %s", path[:100], exc)
                code, body, ctype, extra = 500, b"internal error\n", "text/plain", {}
            await self._write(writer, method, code, body, ctype, extra)
        finally:
            self._waiting.pop(writer, None)
            self._open.discard(writer)
            writer.close()

    async def _write(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        code: int,
        body: bytes,
        ctype: str,
        extra: dict | None = None,
    ) -> None:
        head = [f"HTTP/1.1 {code} {REASONS.get(code, 'Error')}", "Server: hetps",
                f"Content-Type: {ctype}", f"Content-Length: {len(body)}",
                "X-Content-Type-Options: nosniff", "Cache-Control: no-store",
                "Connection: close"]  # fmt: skip
        head += [f"{k}: {v}" for k, v in (extra or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if method != "HEAD":
            writer.write(body)
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError, OSError):
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)

    def _make_room(self) -> None:
        """Close the oldest connections still waiting for their request while the open ones
        are :data:`MAX_CONNECTIONS` or more."""
        while len(self._open) >= MAX_CONNECTIONS and self._waiting:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            self._open.discard(oldest)
            oldest.transport.abort()
            self.evicted += 1

    # -- stopping -----------------------------------------------------------------------------
    def _close_servers(self) -> None:
        for srv in self._servers:
            srv.close()

    async def _stop(self) -> None:
        self._close_servers()
        for w in list(self._open):
            w.transport.abort()
        for srv in self._servers:
            await srv.wait_closed()

    def close(self) -> None:
        """Stop listening, close every connection, stop the thread (idempotent)."""
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=5)
        except Exception as exc:  # noqa: BLE001 - stopping goes on
            log.debug("metrics: stopping the endpoint: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self._loop.close()


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host is an IPv6 address)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def loopback_twin(host: str) -> str:
    """The loopback address of ``host``'s family (the second address a non-loopback endpoint
    binds, so that ``kubectl port-forward``, which connects to loopback in the pod, reaches
    it)."""
    return "::1" if ":" in host else "127.0.0.1"
