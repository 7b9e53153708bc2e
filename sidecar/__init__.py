"""llama-sidecar: a keepalive-aware HTTP/1.1 reverse proxy for llama-server.

The package is split into pure, sans-I/O modules (:mod:`sidecar.sse`,
:mod:`sidecar.notices`, :mod:`sidecar.keepalive`, :mod:`sidecar.headers`,
:mod:`sidecar.errors`) and the I/O layer (:mod:`sidecar.adapter`,
:mod:`sidecar.upstream`, :mod:`sidecar.relay`, :mod:`sidecar.server`,
:mod:`sidecar.metrics`).  The programmatic entry points live in
:mod:`sidecar.server` (``serve``, ``Sidecar``); the helpers that run a sidecar in a
thread or a child process for tests are in ``tests/support/sidecar.py``.
"""

__version__ = "0.1.0"
