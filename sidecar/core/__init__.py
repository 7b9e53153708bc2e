"""The pure core: bytes and times in, decisions out (no sockets, clocks, threads or processes)."""
