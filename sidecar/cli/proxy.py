"""``llama-sidecar proxy``: the sidecar alone in front of any llama-server.

Parses the options (each also read from ``LLAMA_SIDECAR_<NAME>``) into a frozen
:class:`~sidecar.config.Config` and calls :func:`run_proxy`.  SIGTERM or SIGINT
start a graceful drain (``--drain-timeout``); a second signal stops at once.
Once both listeners are bound, one line is printed on stdout::

    llama-sidecar: listening on http://127.0.0.1:8081 metrics http://127.0.0.1:9464/metrics

(:func:`sidecar.server.start_subprocess` waits for it.)
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Annotated

import anyio
import anyio.abc
import typer

from sidecar.config import Config
from sidecar.server import Sidecar, _use_uvloop

__all__ = ["main", "proxy", "run_proxy"]

_E = "LLAMA_SIDECAR_"


def proxy(
    upstream: Annotated[
        str, typer.Option(envvar=_E + "UPSTREAM", help="llama-server base URL (http://HOST:PORT).")
    ] = "http://127.0.0.1:8080",
    listen: Annotated[
        str, typer.Option(envvar=_E + "LISTEN", help="Proxy listen address HOST:PORT.")
    ] = "127.0.0.1:8081",
    metrics_listen: Annotated[
        str,
        typer.Option(
            envvar=_E + "METRICS_LISTEN",
            help="Metrics listen address HOST:PORT (/metrics, /healthz, /ready); empty to disable.",
        ),
    ] = "127.0.0.1:9464",
    park_keepalive: Annotated[
        float,
        typer.Option(
            envvar=_E + "PARK_KEEPALIVE", help="Max client silence (s) while a prompt is parked."
        ),
    ] = 1.0,
    idle_keepalive: Annotated[
        float,
        typer.Option(envvar=_E + "IDLE_KEEPALIVE", help="Max client silence (s) on SSE otherwise."),
    ] = 10.0,
    early_open_after: Annotated[
        float | None,
        typer.Option(
            envvar=_E + "EARLY_OPEN_AFTER",
            help="Answer 200 text/event-stream to a streaming request if upstream is silent "
            "this long (off by default: it turns a 4xx into a 200 plus an error event).",
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            envvar=_E + "DRAIN_TIMEOUT", help="On SIGTERM, seconds running streams may finish in."
        ),
    ] = 30.0,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=_E + "API_KEY",
            help="Require 'Authorization: Bearer KEY' (or X-Api-Key) before forwarding.",
        ),
    ] = None,
    max_body: Annotated[
        int, typer.Option(envvar=_E + "MAX_BODY", help="Largest request body in bytes (413).")
    ] = 32 * 1024 * 1024,
    header_timeout: Annotated[
        float,
        typer.Option(envvar=_E + "HEADER_TIMEOUT", help="Seconds a client has for its headers."),
    ] = 10.0,
    upstream_client: Annotated[
        str,
        typer.Option(
            envvar=_E + "UPSTREAM_CLIENT", help="Upstream HTTP client: h11 (default) or httpx."
        ),
    ] = "h11",
    ready_poll: Annotated[
        float,
        typer.Option(
            envvar=_E + "READY_POLL",
            help="Seconds between reads of llama-server's /metrics for /ready.",
        ),
    ] = 1.0,
    ready_min_free_kv: Annotated[
        float,
        typer.Option(
            envvar=_E + "READY_MIN_FREE_KV",
            help="/ready answers 503 while the free share of the KV pool is below this "
            "(0 to 1; needs the kv_cells gauges of the patched server). Parked requests "
            "always make it 503.",
        ),
    ] = 0.0,
    log_level: Annotated[
        str, typer.Option(envvar=_E + "LOG_LEVEL", help="Logging level (access log is INFO).")
    ] = "INFO",
) -> None:
    """Run the keepalive-aware reverse proxy in front of a llama-server."""
    try:
        config = Config(
            upstream=upstream,
            listen=listen,
            metrics_listen=metrics_listen or None,
            park_keepalive=park_keepalive,
            idle_keepalive=idle_keepalive,
            early_open_after=early_open_after,
            drain_timeout=drain_timeout,
            api_key=api_key or None,
            max_body=max_body,
            header_timeout=header_timeout,
            upstream_client=upstream_client,  # type: ignore[arg-type]
            ready_poll=ready_poll,
            ready_min_free_kv=ready_min_free_kv,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        run_proxy(config)
    except OSError as exc:
        typer.echo(f"llama-sidecar: {exc}; is another process using that port?", err=True)
        raise typer.Exit(1) from exc


def run_proxy(config: Config) -> None:
    """Serve until SIGTERM/SIGINT (graceful drain), blocking."""
    options = {"use_uvloop": True} if _use_uvloop() else {}
    anyio.run(_main, config, backend="asyncio", backend_options=options)


async def _main(config: Config) -> None:
    sidecar = Sidecar(config)
    async with anyio.create_task_group() as tg:

        async def run_then_stop(
            *, task_status: anyio.abc.TaskStatus[Sidecar] = anyio.TASK_STATUS_IGNORED
        ) -> None:
            await sidecar.run(task_status=task_status)
            tg.cancel_scope.cancel()  # drained: stop waiting for signals

        await tg.start(run_then_stop)
        print(
            f"llama-sidecar: listening on {sidecar.url} metrics {sidecar.metrics_url}", flush=True
        )
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            first = True
            async for _ in signals:
                if first:
                    sidecar.drain()
                    first = False
                else:
                    sidecar.stop()


def main() -> None:
    """Run only this command (used by :func:`sidecar.server.start_subprocess`)."""
    typer.run(proxy)


if __name__ == "__main__":
    main()
