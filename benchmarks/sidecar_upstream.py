"""A fast fake llama-server for the relay benchmarks (raw asyncio, own process).

Paths (GET, keep-alive):
  /tput?n=N           N SSE events as fast as the reader takes them (one write each)
  /rate?n=N&hz=H      N events at H per second, each carrying its send time in ns
                      (CLOCK_MONOTONIC, comparable across processes)
  /park?secs=T        ': preempted', silence for T seconds, ': resumed', one event

Events look like llama-server chat chunks (~200 bytes).  Run:
``python -m benchmarks.sidecar_upstream PORT``; prints ``ready PORT``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import parse_qs, urlsplit

HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def event(i: int, t: int = 0) -> bytes:
    payload = {
        "choices": [{"finish_reason": None, "index": 0, "delta": {"content": f" tok{i}"}}],
        "created": 1700000000,
        "id": "chatcmpl-benchmark0000000000000",
        "model": "gemma-3-270m",
        "object": "chat.completion.chunk",
        "t": t,
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


END = b"0\r\n\r\n"


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode()
            url = urlsplit(target)
            q = {k: v[0] for k, v in parse_qs(url.query).items()}
            writer.write(HEAD)
            if url.path == "/tput":
                ev = chunk(event(0))
                for i in range(int(q.get("n", "1000"))):
                    writer.write(ev)
                    if i % 32 == 31:
                        await writer.drain()
            elif url.path == "/rate":
                n, period = int(q.get("n", "100")), 1.0 / float(q.get("hz", "50"))
                start = time.monotonic()
                for i in range(n):
                    delay = start + i * period - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    writer.write(chunk(event(i, time.monotonic_ns())))
            elif url.path == "/park":
                writer.write(chunk(event(0)) + chunk(b": preempted\n\n"))
                await writer.drain()
                await asyncio.sleep(float(q.get("secs", "10")))
                writer.write(chunk(b": resumed\n\n") + chunk(event(1)))
            writer.write(END)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    print("ready", server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
