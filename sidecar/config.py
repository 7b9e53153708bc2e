"""Sidecar configuration: one frozen dataclass whose fields are the table of options.

Every field of :class:`Config` is an option, described once, where it is declared:
its type, its default and its help text (``field(metadata={"help": ...})``).
:data:`OPTIONS` is derived from those fields, and everything else is derived
from :data:`OPTIONS`:

* the flag ``--`` + the name with dashes (``--park-keepalive``),
* the environment variable ``LLAMA_SIDECAR_`` + the name in upper case
  (``LLAMA_SIDECAR_PARK_KEEPALIVE=0.5``), read by :meth:`Config.from_env` and
  by the ``proxy`` command (a flag beats the environment),
* the parameters and ``--help`` of the ``proxy`` command and of ``up``, which
  takes every option but ``upstream`` (:mod:`sidecar.cli.options`),
* the command line that reproduces a config in a child process
  (:func:`config_argv`, used by ``up`` and by ``tests/support/sidecar.py``'s ``start_subprocess``),
* the option tables of the docs (``python -m sidecar.cli.options --write``; a test
  fails when a table differs).

A flag and its variable take the same text and are parsed by the same
:meth:`Option.parse`; for an option that may be unset, the empty string means
unset (``--metrics-listen ""`` disables the metrics listener); a switch takes
``1``/``0`` (also ``true``/``false``, ``yes``/``no``, ``on``/``off``).  Addresses are
``HOST:PORT`` (``[::1]:8081`` for IPv6); both listeners bind loopback by default.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from sidecar.core.priority import PriorityRules, parse_priority_keys, priority_value

__all__ = [
    "ENV_PREFIX",
    "OPTIONS",
    "Config",
    "Option",
    "config_argv",
    "parse_hostport",
    "parse_upstream",
]

ENV_PREFIX = "LLAMA_SIDECAR_"
MiB = 1024 * 1024


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


def _doc(metavar: str, help: str) -> dict[str, str]:
    """A row's description: the flag's metavar and its ``--help`` text."""
    return {"metavar": metavar, "help": help}


@dataclass(frozen=True, slots=True)
class Config:
    # fmt: off
    upstream: str = field(default="http://127.0.0.1:8080", metadata=_doc(
        "URL", "llama-server base URL (http://HOST:PORT; a path prefix is kept)."))
    listen: str = field(default="127.0.0.1:8081", metadata=_doc(
        "HOST:PORT", "Proxy listen address ([::1]:8081 for IPv6; port 0: any free port)."))
    metrics_listen: str | None = field(default="127.0.0.1:9464", metadata=_doc(
        "HOST:PORT", "Metrics listen address (/metrics, /healthz, /ready); empty to disable."))
    park_keepalive: float = field(default=1.0, metadata=_doc(
        "SECONDS", "Longest client silence while a prompt is parked."))
    idle_keepalive: float = field(default=10.0, metadata=_doc(
        "SECONDS", "Longest client silence on any other event stream."))
    early_open_after: float | None = field(default=None, metadata=_doc(
        "SECONDS", "Answer 200 text/event-stream to a streaming request if upstream is silent "
        "this long (off by default: it turns a 4xx into a 200 plus an error event)."))
    drain_timeout: float = field(default=30.0, metadata=_doc(
        "SECONDS", "On SIGTERM, how long running streams may finish (the same under up)."))
    api_key: str | None = field(default=None, metadata=_doc(
        "KEY", "Require 'Authorization: Bearer KEY' (or X-Api-Key) before forwarding (401); "
        "/health stays open."))
    max_body: int = field(default=32 * MiB, metadata=_doc(
        "BYTES", "Largest request body (413 above)."))
    body_buffer: int = field(default=1 * MiB, metadata=_doc(
        "BYTES", "Request bodies up to this size are held in memory, larger ones (up to "
        "--max-body) in a temporary file."))
    max_header_bytes: int = field(default=32 * 1024, metadata=_doc(
        "BYTES", "Largest request head (431 above)."))
    header_timeout: float = field(default=10.0, metadata=_doc(
        "SECONDS", "Time a client has for its whole request head, and for its first byte on "
        "a new connection (408)."))
    body_timeout: float = field(default=120.0, metadata=_doc(
        "SECONDS", "Time a client has for its whole request body, which is read before "
        "upstream is contacted (408)."))
    keepalive_timeout: float = field(default=75.0, metadata=_doc(
        "SECONDS", "An idle keep-alive connection (proxy or metrics listener) is closed after "
        "this long."))
    connect_timeout: float = field(default=5.0, metadata=_doc(
        "SECONDS", "Time to connect to upstream (504)."))
    upstream_head_timeout: float = field(default=600.0, metadata=_doc(
        "SECONDS", "Time upstream has for its response head once the request is sent (504); "
        "llama-server sends it with the first token, or at the end when not streaming."))
    send_timeout: float = field(default=60.0, metadata=_doc(
        "SECONDS", "A client that takes no byte of its response for this long (it stopped "
        "reading) is disconnected and its upstream request cancelled, like nginx's "
        "send_timeout."))
    upstream_max_idle: int = field(default=64, metadata=_doc(
        "N", "Idle upstream keep-alive connections kept in the pool."))
    ready_poll: float = field(default=1.0, metadata=_doc(
        "SECONDS", "How often /ready reads llama-server's /metrics (parked requests); 0 turns "
        "readiness off (no polling, /ready answers 503)."))
    ready_min_free_kv: float = field(default=0.0, metadata=_doc(
        "SHARE", "/ready answers 503 while less than this share (0 to 1) of the KV pool is free; "
        "needs the server's kv_cells gauges. Parked requests always make it 503."))
    priority_keys: str | None = field(default=None, metadata=_doc(
        "KEY=N,...", "Request priority by API key ('KEY=10,OTHER=-5'), set as \"priority\" on "
        "the JSON body of completion requests (llama-server parks the lowest first)."))
    priority_header: str | None = field(default=None, metadata=_doc(
        "HEADER", "Take the priority from this request header (X-Priority, say) when the key "
        "has none; name only a header that a trusted hop sets or strips."))
    priority_default: int = field(default=0, metadata=_doc(
        "N", "Priority of the requests no rule matches, once any priority rule is set "
        "(a client's own \"priority\" field is then always overwritten)."))
    log_level: str = field(default="INFO", metadata=_doc(
        "LEVEL", "Logging level: DEBUG, INFO, WARNING or ERROR (the access log is INFO)."))
    uvloop: bool = field(default=False, metadata=_doc(
        "0|1", "Run on uvloop if it is installed (never required; it saves CPU per event and "
        "costs a little in bulk, docs/benchmarks.md)."))
    # fmt: on

    def __post_init__(self) -> None:
        parse_upstream(self.upstream)
        parse_hostport(self.listen)
        if self.metrics_listen:
            parse_hostport(self.metrics_listen)
        for name in (
            "park_keepalive", "idle_keepalive", "header_timeout", "body_timeout",
            "keepalive_timeout", "connect_timeout", "upstream_head_timeout", "send_timeout",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.early_open_after is not None and self.early_open_after <= 0:
            raise ValueError("early_open_after must be positive")
        for name in ("drain_timeout", "max_body", "body_buffer", "upstream_max_idle"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.max_header_bytes <= 0:
            raise ValueError("max_header_bytes must be positive")
        if self.ready_poll < 0:
            raise ValueError("ready_poll must not be negative")
        if not 0.0 <= self.ready_min_free_kv < 1.0:
            raise ValueError("ready_min_free_kv is a share of the pool: 0 <= share < 1")
        if self.log_level.upper() not in _LEVELS:
            raise ValueError(f"log_level: one of {', '.join(_LEVELS)}, not {self.log_level!r}")
        # the priority options parse: a bad key list is a startup error, not a per-request one
        _ = self.priority_rules

    @property
    def priority_rules(self) -> PriorityRules:
        header = self.priority_header.strip().lower().encode() if self.priority_header else None
        if header is not None and not header.replace(b"-", b"").isalnum():
            raise ValueError(f"priority_header: not a header name: {self.priority_header!r}")
        by_key = parse_priority_keys(self.priority_keys)
        default = priority_value(self.priority_default, "priority_default")
        return PriorityRules(by_key, header, default)

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
        return cls.from_text(environ_values(environ), **overrides)

    @classmethod
    def from_text(cls, raw: Mapping[str, str], **overrides: Any) -> Config:
        """Defaults, then ``raw`` (option name -> flag text), then ``overrides``."""
        values: dict[str, Any] = {name: OPTION_BY_NAME[name].parse(text) for name, text in
                                  raw.items()}  # fmt: skip
        values.update(overrides)
        return cls(**values)


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SWITCH = {"1": True, "true": True, "yes": True, "on": True,
           "0": False, "false": False, "no": False, "off": False, "": False}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Option:
    """One row of the table, derived from a :class:`Config` field."""

    name: str
    type: type  # str, int, float or bool
    optional: bool  # may be unset (None); the empty string unsets it
    default: Any
    help: str
    metavar: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def parse(self, raw: str) -> Any:
        """Flag or environment text -> value (``ValueError`` names the variable)."""
        if raw == "" and self.optional:
            return None
        try:
            if self.type is bool:
                return _SWITCH[raw.strip().lower()]
            return self.type(raw)
        except (ValueError, KeyError):
            what = {int: "an integer", float: "a number", bool: "1 or 0"}.get(self.type, "valid")
            raise ValueError(f"{self.flag} / {self.env}: not {what}: {raw!r}") from None

    def format(self, value: Any) -> str:
        """Value -> the text :meth:`parse` turns back into it."""
        if value is None:
            return ""
        if self.type is bool:
            return "1" if value else "0"
        return str(value)


def _option(f: dataclasses.Field[Any], hint: Any) -> Option:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is Literal:
        hint = str
    assert hint in (str, int, float, bool), f"Config.{f.name}: unsupported type {hint!r}"
    return Option(f.name, hint, optional, f.default, f.metadata["help"], f.metadata["metavar"])


_HINTS = typing.get_type_hints(Config)
OPTIONS: tuple[Option, ...] = tuple(_option(f, _HINTS[f.name]) for f in dataclasses.fields(Config))
OPTION_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def environ_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``LLAMA_SIDECAR_*`` variables that name an option, by option name."""
    env = os.environ if environ is None else environ
    return {o.name: env[o.env] for o in OPTIONS if o.env in env}


def config_argv(config: Config, names: Iterable[str] | None = None) -> list[str]:
    """The ``llama-sidecar proxy`` flags that reproduce ``config`` (or just ``names``).

    Every option is given by default, so that ``LLAMA_SIDECAR_*`` variables the
    child inherits cannot change what the caller configured.
    """
    wanted = [OPTION_BY_NAME[n] for n in names] if names is not None else OPTIONS
    argv: list[str] = []
    for o in wanted:
        argv += [o.flag, o.format(getattr(config, o.name))]
    return argv
