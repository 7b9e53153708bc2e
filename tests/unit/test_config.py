"""Config parsing, LLAMA_SIDECAR_* environment, metric label helpers."""

from __future__ import annotations

import pytest

from sidecar.config import Config, parse_hostport, parse_upstream
from sidecar.metrics import route_label, status_class


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8081", ("127.0.0.1", 8081)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
        ("[::1]:9464", ("::1", 9464)),
        (":8081", ("127.0.0.1", 8081)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_parse_hostport(text: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(text) == expected


@pytest.mark.parametrize("text", ["8081", "host:", "host:x", "host:70000", ""])
def test_parse_hostport_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_hostport(text)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8080", ("127.0.0.1", 8080, "")),
        ("http://llama:8080/api/", ("llama", 8080, "/api")),
        ("localhost:9000", ("localhost", 9000, "")),
        ("http://example", ("example", 80, "")),
    ],
)
def test_parse_upstream(url: str, expected: tuple[str, int, str]) -> None:
    assert parse_upstream(url) == expected


def test_parse_upstream_rejects_https() -> None:
    with pytest.raises(ValueError, match="http://"):
        parse_upstream("https://x:1")


def test_defaults_bind_loopback() -> None:
    c = Config()
    assert c.listen_addr == ("127.0.0.1", 8081)
    assert c.metrics_addr == ("127.0.0.1", 9464)
    assert (c.park_keepalive, c.idle_keepalive, c.early_open_after) == (1.0, 10.0, None)


def test_from_env() -> None:
    env = {
        "LLAMA_SIDECAR_UPSTREAM": "http://10.0.0.2:8080",
        "LLAMA_SIDECAR_PARK_KEEPALIVE": "0.5",
        "LLAMA_SIDECAR_MAX_BODY": "1000",
        "LLAMA_SIDECAR_EARLY_OPEN_AFTER": "3",
        "LLAMA_SIDECAR_API_KEY": "k",
        "LLAMA_SIDECAR_METRICS_LISTEN": "",
        "UNRELATED": "x",
    }
    c = Config.from_env(env, idle_keepalive=5.0)
    assert c.upstream == "http://10.0.0.2:8080"
    assert c.park_keepalive == 0.5 and c.idle_keepalive == 5.0
    assert c.max_body == 1000 and c.early_open_after == 3.0 and c.api_key == "k"
    assert c.metrics_listen is None


def test_from_env_bad_number() -> None:
    with pytest.raises(ValueError, match="LLAMA_SIDECAR_PARK_KEEPALIVE"):
        Config.from_env({"LLAMA_SIDECAR_PARK_KEEPALIVE": "soon"})


@pytest.mark.parametrize(
    "changes",
    [{"park_keepalive": 0}, {"idle_keepalive": -1}, {"early_open_after": 0},
     {"upstream_client": "curl"}, {"listen": "nope"}, {"upstream": "ftp://x"}],
)  # fmt: skip
def test_validation(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Config(**changes)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    c = Config()
    with pytest.raises(AttributeError):
        c.listen = "x"  # type: ignore[misc]
    assert c.replace(listen="127.0.0.1:1").listen == "127.0.0.1:1"


@pytest.mark.parametrize(
    ("target", "label"),
    [
        (b"/v1/chat/completions", "/v1/chat/completions"),
        (b"/v1/chat/completions?x=1", "/v1/chat/completions"),
        (b"/completion/", "/completion"),
        (b"/slots/0?action=save", "/slots"),
        (b"/health", "/health"),
        (b"/", "/"),
        (b"/users/123", "other"),
        (b"*", "other"),
        ("/v1/models", "/v1/models"),
    ],
)
def test_route_label(target: bytes | str, label: str) -> None:
    assert route_label(target) == label


@pytest.mark.parametrize(
    ("status", "cls"),
    [(200, "2xx"), (101, "1xx"), (404, "4xx"), (502, "5xx"), (None, "none"), (0, "none")],
)
def test_status_class(status: int | None, cls: str) -> None:
    assert status_class(status) == cls
