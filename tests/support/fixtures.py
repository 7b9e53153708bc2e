"""The sidecar fixtures the proxy and hostile suites share (their conftests import them).

``fake`` is a scripted :class:`~tests.support.fake_upstream.FakeUpstream`; ``sidecar_factory``
starts a :class:`~sidecar.server.Sidecar` in the test's event loop (each with its own
metrics registry); ``sidecar`` is one in front of ``fake``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry

from sidecar.server import Sidecar
from tests.support.fake_upstream import FakeUpstream
from tests.support.sidecar import ephemeral_config

__all__ = ["SidecarFactory", "anyio_backend", "fake", "sidecar", "sidecar_factory"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as f:
        yield f


SidecarFactory = Callable[..., AbstractAsyncContextManager[Sidecar]]


@pytest.fixture
def sidecar_factory() -> SidecarFactory:
    """``async with sidecar_factory(upstream_url, **config) as sc``: a running sidecar."""

    @asynccontextmanager
    async def start(upstream: str, **overrides: Any) -> AsyncIterator[Sidecar]:
        config = ephemeral_config(upstream, **overrides)
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
