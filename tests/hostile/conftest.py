"""Hostile clients and a lying upstream against a sidecar on loopback.

The fixtures are the proxy tests' (:mod:`tests.support.fixtures`: a scripted
:class:`~tests.support.fake_upstream.FakeUpstream` and a sidecar in the test's event loop);
the raw-socket client is :class:`~tests.support.rawclient.RawConn`.  Every test names the
behaviour it pins down and sends exact bytes, like nginx-tests and HAProxy's reg-tests.
"""

from __future__ import annotations

from tests.support.fixtures import anyio_backend, fake, net, sidecar, sidecar_factory

__all__ = ["anyio_backend", "fake", "net", "sidecar", "sidecar_factory"]
