"""Fixtures for the proxy tests: a fake upstream and a sidecar in the test's event loop."""

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
