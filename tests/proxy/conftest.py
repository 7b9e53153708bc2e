"""Fixtures for the proxy tests: a fake upstream and a sidecar in the test's event loop
(:mod:`tests.support.fixtures`, shared with the hostile suite)."""

from __future__ import annotations

from tests.support.fixtures import anyio_backend, fake, net, sidecar, sidecar_factory

__all__ = ["anyio_backend", "fake", "net", "sidecar", "sidecar_factory"]
