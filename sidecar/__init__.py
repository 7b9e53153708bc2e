"""llama-sidecar: a keepalive-aware HTTP/1.1 reverse proxy for llama-server.

The package is split into pure, sans-I/O modules (:mod:`sidecar.core.sse`,
:mod:`sidecar.core.notices`, :mod:`sidecar.core.keepalive`, :mod:`sidecar.core.headers`,
:mod:`sidecar.core.errors`) and the I/O layer (:mod:`sidecar.proxy.h11stream`,
:mod:`sidecar.proxy.upstream`, :mod:`sidecar.proxy.relay`, :mod:`sidecar.proxy.server`,
:mod:`sidecar.proxy.metrics`).  The programmatic entry points live in
:mod:`sidecar.proxy.server` (``serve``, ``Sidecar``); the helpers that run a sidecar in a
thread or a child process for tests are in ``tests/support/sidecar.py``.
"""

__version__ = "0.1.0"
