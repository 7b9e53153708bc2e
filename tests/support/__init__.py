"""Test tooling shared by every suite and benchmark (imported from the checkout's root).

procs (ManagedProcess, free_port, wait_until), llama, nginx, prometheus, haproxy, up, sidecar,
sse_client, fake_upstream, tinymodel: see README.md, "Tests".
"""
