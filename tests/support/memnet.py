"""An in-memory network for the proxy and hostile suites: no socket, no listener.

A module (or a test) marked ``in_memory`` gets a :class:`MemoryNet` from the ``net``
fixture, and the shared fixtures (:mod:`tests.support.fixtures`) put the sidecar's two
listeners and the fake upstream on it at made-up addresses (``sidecar.test``,
``upstream.test``): a connection is a :func:`~tests.protocol.memory.memory_pair` whose far
end is handed to the listener's connection handler, so the sidecar runs its own connection
loop (:meth:`~sidecar.proxy.server.Sidecar.serve_client`) and its upstream pool connects through
:meth:`MemoryNet.connect`.  The clients find it by URL: :meth:`RawConn.open
<tests.support.rawclient.RawConn.open>` and :func:`http_client` (an httpx client whose
connections come from the net) reach a memory address through it and anything else
through a socket.

What it does not model, so those tests keep loopback sockets: kernel buffers (a peer that
stops reading never blocks a writer), resets (a closed end gives the other EOF), accept
queues, descriptor limits, TCP half-close on the wire, child processes.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import httpcore
import httpx

from sidecar.proxy.transport import TransportStream
from tests.protocol.memory import memory_pair

Handler = Callable[[TransportStream], Coroutine[Any, Any, None]]
# what the sidecar sees as the client's address (X-Forwarded-For), as on loopback
CLIENT_HOST = "127.0.0.1"

_current: MemoryNet | None = None


class MemoryNet:
    def __init__(self) -> None:
        self._hosts: dict[tuple[str, int], Handler] = {}
        self._ports = itertools.count(10000)
        self._client_ports = itertools.count(40000)
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> MemoryNet:
        global _current
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        _current = self
        return self

    async def __aexit__(self, *exc: object) -> None:
        global _current
        _current = None
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)

    def listen(self, host: str, handler: Handler) -> tuple[str, int]:
        """A new address on ``host`` whose connections go to ``handler`` (it closes them)."""
        addr = (host, next(self._ports))
        self._hosts[addr] = handler
        return addr

    def serves(self, host: str, port: int) -> bool:
        return (host, port) in self._hosts

    async def connect(self, host: str, port: int) -> TransportStream:
        """A connection to a listening address (refused otherwise), as a socket's would be."""
        handler = self._hosts.get((host, port))
        if handler is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        ours, theirs = memory_pair((CLIENT_HOST, next(self._client_ports)), (host, port))
        assert self._tg is not None
        self._tg.start_soon(handler, theirs)
        return ours


def current() -> MemoryNet | None:
    """The net of the running test, if it has one."""
    return _current


async def open_stream(url: str) -> anyio.abc.ByteStream:
    """A connection to ``url``'s host and port: through the net if it serves it, else TCP."""
    parts = urlsplit(url)
    assert parts.hostname
    assert parts.port
    net = _current
    if net is not None and net.serves(parts.hostname, parts.port):
        return await net.connect(parts.hostname, parts.port)
    return await anyio.connect_tcp(parts.hostname, parts.port)


# ------------------------------------------------------------------ httpx on the net


class _NetworkStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            with anyio.fail_after(timeout):
                return await self.stream.receive(max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return b""
        except anyio.BrokenResourceError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            with anyio.fail_after(timeout):
                await self.stream.send(buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        await self.stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return None


class _Backend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            with anyio.fail_after(timeout):
                return _NetworkStream(await open_stream(f"http://{host}:{port}"))
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


class _Transport(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        # httpx's own request and error mapping over a pool whose connections come from
        # _Backend (httpx has no public way to give its pool a network backend)
        limits = httpx.Limits()
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )


def http_client(**options: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` that reaches the net's addresses in memory (others by TCP).

    With no net (a test not marked ``in_memory``) it is a plain ``httpx.AsyncClient``.
    """
    if _current is None:
        return httpx.AsyncClient(**options)
    return httpx.AsyncClient(transport=_Transport(), **options)
