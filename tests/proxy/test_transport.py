"""TransportStream on loopback sockets: byte-stream semantics, sinks, back-pressure."""

from __future__ import annotations

import asyncio
import socket

import anyio
import pytest

from sidecar.core.chunked import ChunkedDecoder
from sidecar.proxy.transport import READ_HIGH_WATER, TransportStream, accepted, connect
from sidecar.proxy.upstream import Framing, ResponseHead, _BodySink

pytestmark = pytest.mark.anyio
CHUNKED = ResponseHead(200, b"OK", [], framing=Framing.CHUNKED)


async def _pair() -> tuple[TransportStream, TransportStream]:
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        port = lsock.getsockname()[1]
        conn_task = asyncio.ensure_future(connect("127.0.0.1", port))
        sock, _ = await loop.sock_accept(lsock)
        server = await accepted(sock)
        return await conn_task, server
    finally:
        lsock.close()


async def test_receive_send_eof_and_close() -> None:
    a, b = await _pair()
    await a.send(b"hello")
    assert await b.receive() == b"hello"
    await a.send(b"x" * 10)
    await anyio.sleep(0.05)
    assert await b.receive(4) == b"xxxx"  # max_bytes honoured, the rest kept
    assert await b.receive() == b"x" * 6
    await a.send_eof()
    with pytest.raises(anyio.EndOfStream):
        await b.receive()
    await b.send(b"still writable after the peer's EOF")
    assert await a.receive() == b"still writable after the peer's EOF"
    await a.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await a.receive()
    async def read_until_closed() -> None:
        for _ in range(100):  # until the loop has seen the close
            await b.receive()

    with pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
        await read_until_closed()
    await b.aclose()


async def test_reading_pauses_when_nobody_reads() -> None:
    a, b = await _pair()
    piece = b"y" * 65536
    sent = 0
    with anyio.move_on_after(1.0) as scope:
        while True:  # until b stopped reading and the kernel buffers filled
            sent += len(piece)
            await a.send(piece)  # writes at once, then waits for the kernel buffer
    assert scope.cancel_called
    assert b._queued <= READ_HIGH_WATER + 256 * 1024  # bounded, not everything sent
    got = bytearray()
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.drain)
        while len(got) < sent:
            got += await b.receive()
    assert bytes(got) == b"y" * sent
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("framed", [False, True])
async def test_sink_back_pressure_keeps_every_byte_in_order(framed: bool) -> None:
    """A chunked body relayed by the sink to a downstream that reads slowly.

    ``framed``: the pass-through path, where the downstream gets the upstream's
    whole chunks as they are and the rest re-framed; decoded, it is the same body.
    Otherwise the downstream gets the decoded pieces (``wire`` unused).
    """
    up_srv, up = await _pair()  # upstream server side writes, `up` is the sidecar's end
    down, client = await _pair()  # sidecar writes to `down`, `client` reads slowly
    pieces = [b"data: %d %s\n\n" % (i, b"z" * 2000) for i in range(3000)]
    body = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    blocked = 0
    passed_through = 0

    def deliver(data: bytes, wire: bytes | None = None) -> bool:
        nonlocal passed_through
        if framed:
            if wire is not None:
                passed_through += 1
            down.write(wire if wire is not None else b"%x\r\n%b\r\n" % (len(data), data))
        else:
            down.write(data)
        return down.write_paused

    sink = _BodySink(up, CHUNKED, deliver)
    assert up.set_sink(sink) == b""
    got = bytearray()
    total = sum(map(len, pieces))
    decoded = bytearray()  # framed: what the client's chunked decoder made of `got`
    client_decoder = ChunkedDecoder()

    async def upstream() -> None:
        await up_srv.send(body)

    async def slow_client() -> None:
        while len(decoded if framed else got) < total:
            data = await client.receive()
            got.extend(data)
            if framed:
                decoded.extend(client_decoder.feed(data))
            if len(got) < 1_000_000:
                await anyio.sleep(0.001)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(upstream)
            tg.start_soon(slow_client)
            while not sink.finished:
                assert sink.error is None
                await sink.wait()
                if sink.blocked:
                    blocked += 1
                    await down.drain()
                    sink.unblock()
    up.set_sink(None)
    if framed:
        # Framing may differ from upstream's where a read split a chunk.
        assert bytes(decoded) == b"".join(pieces)
        assert client_decoder.idle  # ends at a chunk boundary
        assert passed_through > 0
    else:
        assert bytes(got) == b"".join(pieces)
    assert blocked > 0  # downstream really pushed back
    for s in (up_srv, up, down, client):
        await s.aclose()


async def test_sink_reports_upstream_gone_mid_body() -> None:
    up_srv, up = await _pair()
    sink = _BodySink(up, CHUNKED, lambda data, wire: False)
    up.set_sink(sink)
    await up_srv.send(b"5\r\nhello\r\n")
    await up_srv.aclose()
    with anyio.fail_after(2):
        while sink.error is None:
            await sink.wait()
    assert "mid-response" in str(sink.error)
    await up.aclose()
