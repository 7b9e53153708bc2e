"""``llama-sidecar proxy``: the sidecar alone in front of any llama-server.

The options are the rows of :data:`sidecar.config.OPTIONS` (each also read from
``LLAMA_SIDECAR_<NAME>``; :mod:`sidecar.cli.options`); they are parsed into a frozen
:class:`~sidecar.config.Config` and :func:`run_proxy` is called.  SIGTERM or SIGINT
start a graceful drain (``--drain-timeout``); a second signal stops at once.
Once both listeners are bound, one line is printed on stdout::

    llama-sidecar: listening on http://127.0.0.1:8081 metrics http://127.0.0.1:9464/metrics

(``tests/support/sidecar.py``'s ``start_subprocess`` waits for it.)
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

import anyio
import anyio.abc
import typer

from sidecar.cli.options import config_from, with_table
from sidecar.config import Config
from sidecar.proxy.server import Sidecar, _use_uvloop

__all__ = ["main", "proxy", "run_proxy"]


def proxy(**given: Any) -> None:
    """Run the keepalive-aware reverse proxy in front of a llama-server."""
    config = config_from(given)
    logging.basicConfig(
        level=config.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(name)s %(message)s",
    )  # fmt: skip
    try:
        run_proxy(config)
    except OSError as exc:
        typer.echo(f"llama-sidecar: {exc}; is another process using that port?", err=True)
        raise typer.Exit(1) from exc


with_table(proxy)


def run_proxy(config: Config) -> None:
    """Serve until SIGTERM/SIGINT (graceful drain), blocking."""
    options = {"use_uvloop": True} if _use_uvloop(config) else {}
    anyio.run(_main, config, backend="asyncio", backend_options=options)


async def _main(config: Config) -> None:
    sidecar = Sidecar(config)
    # The handlers go in before the sidecar starts, so that a signal sent as soon as the
    # "listening" line is read drains (the receiver queues it) instead of killing.
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def run_then_stop(
                *, task_status: anyio.abc.TaskStatus[Sidecar] = anyio.TASK_STATUS_IGNORED
            ) -> None:
                await sidecar.run(task_status=task_status)
                tg.cancel_scope.cancel()  # drained: stop waiting for signals

            await tg.start(run_then_stop)
            print(
                f"llama-sidecar: listening on {sidecar.url} metrics {sidecar.metrics_url}",
                flush=True,
            )
            first = True
            async for _ in signals:
                if first:
                    sidecar.drain()
                    first = False
                else:
                    sidecar.stop()


def main() -> None:
    """Run only this command (how `up` and the tests start the sidecar in a child)."""
    typer.run(proxy)


if __name__ == "__main__":
    main()
