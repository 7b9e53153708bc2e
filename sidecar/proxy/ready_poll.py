"""The readiness poller: llama-server's ``/metrics`` read through the proxy's own upstream pool.

The policy (:class:`~sidecar.core.readiness.Readiness`) is pure; this is its one I/O.  Every
``ready_poll`` seconds it GETs ``/metrics`` (under the upstream's base path, as a relayed
request would be) on a pooled keep-alive connection of the same
:class:`~sidecar.proxy.upstream.UpstreamPool` the exchanges use, so the process has one HTTP
client, and a reading costs no connection of its own.  A reading is bounded in time (the
poll interval, at least 1 s) and in size (``MAX_READING_BYTES``); past either it is a failed
poll, and the connection is closed rather than pooled.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from sidecar.config import format_hostport
from sidecar.core.errors import UpstreamError
from sidecar.core.readiness import MAX_READING_BYTES, Readiness
from sidecar.proxy.upstream import UpstreamPool

__all__ = ["poll_upstream", "read_metrics"]


async def poll_upstream(
    readiness: Readiness,
    pool: UpstreamPool,
    *,
    clock: Callable[[], float] = anyio.current_time,
) -> None:
    """Feed ``readiness`` from upstream's ``/metrics`` every poll interval, until cancelled."""
    interval = readiness.poll_interval
    while True:
        started = clock()
        try:
            with anyio.fail_after(max(interval, 1.0)):
                text, why = await read_metrics(pool)
        except TimeoutError:
            text, why = None, "timed out"
        except UpstreamError as exc:
            text, why = None, type(exc).__name__
        if text is not None:
            readiness.observe(text, clock())
        else:
            readiness.failed(why, clock())
        await anyio.sleep(max(0.0, interval - (clock() - started)))


async def read_metrics(pool: UpstreamPool) -> tuple[str | None, str]:
    """The metrics text, or None and why not (an HTTP status, a body over the size limit)."""
    headers = [(b"Host", format_hostport(pool.host, pool.port).encode())]
    resp = await pool.request(b"GET", b"/metrics", headers, None)
    try:
        if resp.head.status != 200:
            return None, f"HTTP {resp.head.status}"
        body = await resp.read(MAX_READING_BYTES + 1)
        if len(body) > MAX_READING_BYTES:
            return None, f"metrics response over {MAX_READING_BYTES} bytes"
        return body.decode("utf-8", "replace"), ""
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()
