"""Sidecar configuration: one frozen dataclass, filled from flags or ``LLAMA_SIDECAR_*``.

Every field has an environment variable named ``LLAMA_SIDECAR_`` + the field
name in upper case (``LLAMA_SIDECAR_PARK_KEEPALIVE=0.5``).  :meth:`Config.from_env`
reads them; the CLI passes the same names to typer so a flag beats the
environment.  Addresses are ``HOST:PORT`` (``[::1]:8081`` for IPv6); both
listeners bind loopback by default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = ["ENV_PREFIX", "Config", "parse_hostport", "parse_upstream"]

ENV_PREFIX = "LLAMA_SIDECAR_"
UpstreamClientName = Literal["h11", "httpx"]


def parse_hostport(value: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"HOST:PORT"``, ``"[V6]:PORT"`` or ``":PORT"`` -> ``(host, port)``."""
    value = value.strip()
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
    else:
        host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return (host or default_host), int(port)


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_upstream(url: str) -> tuple[str, int, str]:
    """``http://host:port[/base]`` -> ``(host, port, base_path)``; only plain http."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme != "http":
        raise ValueError(f"upstream must be an http:// URL, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"upstream URL has no host: {url!r}")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


@dataclass(frozen=True, slots=True)
class Config:
    upstream: str = "http://127.0.0.1:8080"
    listen: str = "127.0.0.1:8081"
    metrics_listen: str | None = "127.0.0.1:9464"
    park_keepalive: float = 1.0
    idle_keepalive: float = 10.0
    early_open_after: float | None = None
    drain_timeout: float = 30.0
    api_key: str | None = None
    max_body: int = 32 * 1024 * 1024
    max_header_bytes: int = 32 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    connect_timeout: float = 5.0
    upstream_client: UpstreamClientName = "h11"
    upstream_max_idle: int = 64
    ready_poll: float = 1.0
    ready_min_free_kv: float = 0.0

    def __post_init__(self) -> None:
        parse_upstream(self.upstream)
        parse_hostport(self.listen)
        if self.metrics_listen:
            parse_hostport(self.metrics_listen)
        for name in ("park_keepalive", "idle_keepalive", "header_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.early_open_after is not None and self.early_open_after <= 0:
            raise ValueError("early_open_after must be positive")
        if self.drain_timeout < 0 or self.max_body < 0:
            raise ValueError("drain_timeout and max_body must not be negative")
        if self.ready_poll <= 0:
            raise ValueError("ready_poll must be positive")
        if not 0.0 <= self.ready_min_free_kv < 1.0:
            raise ValueError("ready_min_free_kv is a share of the pool: 0 <= share < 1")
        if self.upstream_client not in ("h11", "httpx"):
            raise ValueError("upstream_client must be 'h11' or 'httpx'")

    @property
    def listen_addr(self) -> tuple[str, int]:
        return parse_hostport(self.listen)

    @property
    def metrics_addr(self) -> tuple[str, int] | None:
        return parse_hostport(self.metrics_listen) if self.metrics_listen else None

    @property
    def upstream_addr(self) -> tuple[str, int, str]:
        return parse_upstream(self.upstream)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, then ``LLAMA_SIDECAR_*`` variables, then ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _convert(f.name, str(f.type), raw)
        values.update(overrides)
        return cls(**values)


def _convert(name: str, type_name: str, raw: str) -> Any:
    if raw == "" and "None" in type_name:
        return None
    try:
        if type_name.startswith("float"):
            return float(raw)
        if type_name.startswith("int"):
            return int(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: not a number: {raw!r}") from None
    return raw
