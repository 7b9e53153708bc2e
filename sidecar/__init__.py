"""llama-sidecar: a keepalive-aware HTTP/1.1 reverse proxy for llama-server.

The package is grouped by role.  :mod:`sidecar.core` is pure (sans-I/O: the SSE scanner,
park notices, the keepalive policy, chunk framing, headers, errors, priority, routes, the
readiness policy; bytes and times in, decisions out), :mod:`sidecar.proxy` does the I/O
(listeners, the connection loop, exchanges, both h11 sides, the upstream pool, metrics),
:mod:`sidecar.ops` runs around it (``up``'s supervisor, ``probe``), :mod:`sidecar.cli` is
the commands, and :mod:`sidecar.config` is the one table of options they share.  The
programmatic entry points live in :mod:`sidecar.proxy.server` (``serve``, ``Sidecar``);
the helpers that run a sidecar in a thread or a child process for tests are in
``tests/support/sidecar.py``.
"""

__version__ = "0.1.0"
