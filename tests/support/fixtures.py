"""The sidecar fixtures the proxy and hostile suites share (their conftests import them).

``fake`` is a scripted :class:`~tests.support.fake_upstream.FakeUpstream`; ``sidecar_factory``
starts a :class:`~sidecar.proxy.server.Sidecar` in the test's event loop (each with its own
metrics registry); ``sidecar`` is one in front of ``fake``.  In a test marked ``in_memory``
all of them are on the ``net`` fixture's :class:`~tests.support.memnet.MemoryNet` instead
of loopback sockets (the sidecar then has no listener: its drain and readiness poller are
not running).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from sidecar.proxy.server import Sidecar
from sidecar.proxy.upstream import UpstreamPool
from tests.support.fake_upstream import FakeUpstream
from tests.support.memnet import MemoryNet
from tests.support.sidecar import ephemeral_config

__all__ = ["SidecarFactory", "anyio_backend", "fake", "net", "sidecar", "sidecar_factory"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def net(request: pytest.FixtureRequest) -> AsyncIterator[MemoryNet | None]:
    """The in-memory network of a test marked ``in_memory``; None for the others."""
    if request.node.get_closest_marker("in_memory") is None:
        yield None
        return
    async with MemoryNet() as n:
        yield n


@pytest.fixture
async def fake(net: MemoryNet | None) -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(net=net) as f:
        yield f


SidecarFactory = Callable[..., AbstractAsyncContextManager[Sidecar]]


@pytest.fixture
def sidecar_factory(net: MemoryNet | None) -> SidecarFactory:
    """``async with sidecar_factory(upstream_url, **config) as sc``: a running sidecar."""

    @asynccontextmanager
    async def start(upstream: str, **overrides: Any) -> AsyncIterator[Sidecar]:
        config = ephemeral_config(upstream, **overrides)
        if net is not None:
            pool = UpstreamPool(config, connect=net.connect)
            sc = Sidecar(config, CollectorRegistry(), upstream=pool)
            sc.address = net.listen("sidecar.test", sc.serve_client)
            if config.metrics_addr is not None:
                sc.metrics_address = net.listen("sidecar.test", sc.serve_metrics_client)
            try:
                yield sc
            finally:
                await sc.ctx.upstream.aclose()
            return
        sc = Sidecar(config, CollectorRegistry())
        async with anyio.create_task_group() as tg:
            await tg.start(sc.run)
            try:
                yield sc
            finally:
                sc.stop()

    return start


@pytest.fixture
async def sidecar(fake: FakeUpstream, sidecar_factory: SidecarFactory) -> AsyncIterator[Sidecar]:
    async with sidecar_factory(fake.url) as sc:
        yield sc
