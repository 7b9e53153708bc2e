"""The proxy's I/O path: listeners, the connection loop, exchanges, both h11 sides, metrics."""
