"""Config parsing, LLAMA_SIDECAR_* environment, metric label helpers."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from sidecar.config import OPTIONS, Config, Option, config_argv, parse_hostport, parse_upstream
from sidecar.proxy.metrics import route_label, status_class


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
    with pytest.raises(ValueError, match="expected HOST:PORT"):
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
    assert c.park_keepalive == 0.5
    assert c.idle_keepalive == 5.0
    assert c.max_body == 1000
    assert c.early_open_after == 3.0
    assert c.api_key == "k"
    assert c.metrics_listen is None


def test_from_env_bad_number() -> None:
    with pytest.raises(ValueError, match="LLAMA_SIDECAR_PARK_KEEPALIVE"):
        Config.from_env({"LLAMA_SIDECAR_PARK_KEEPALIVE": "soon"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"park_keepalive": 0}, "park_keepalive must be positive"),
     ({"idle_keepalive": -1}, "idle_keepalive must be positive"),
     ({"early_open_after": 0}, "early_open_after must be positive"),
     ({"upstream_max_idle": -1}, "upstream_max_idle must not be negative"),
     ({"listen": "nope"}, "expected HOST:PORT"),
     ({"upstream": "ftp://x"}, "upstream must be an http:// URL")],
)  # fmt: skip
def test_validation(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
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


# ------------------------------------------------ one table: flags, env, --help, argv

# A valid value other than the default for every option (a new option must add one).
SAMPLES: dict[str, object] = {
    "upstream": "http://10.1.2.3:9000/base",
    "listen": "127.0.0.1:1234",
    "metrics_listen": None,
    "park_keepalive": 0.25,
    "idle_keepalive": 3.5,
    "early_open_after": 2.0,
    "drain_timeout": 7.0,
    "api_key": "secret",
    "max_body": 12345,
    "body_buffer": 999,
    "max_header_bytes": 4096,
    "header_timeout": 2.5,
    "body_timeout": 9.0,
    "keepalive_timeout": 11.0,
    "connect_timeout": 1.5,
    "upstream_head_timeout": 30.0,
    "send_timeout": 4.5,
    "upstream_max_idle": 3,
    "ready_poll": 0.5,
    "ready_min_free_kv": 0.25,
    "priority_keys": "gold=10,batch=-5",
    "priority_header": "X-Priority",
    "priority_default": -1,
    "log_level": "DEBUG",
    "uvloop": True,
}


def _run_cli(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Config:
    from typer.testing import CliRunner

    from sidecar.cli import app, proxy

    seen: list[Config] = []
    monkeypatch.setattr(proxy, "run_proxy", seen.append)
    for o in OPTIONS:  # only what the test gives
        monkeypatch.delenv(o.env, raising=False)
    result = CliRunner().invoke(app, ["proxy", *args], env=env)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_every_option_has_a_sample() -> None:
    assert set(SAMPLES) == {o.name for o in OPTIONS} == {f.name for f in fields(Config)}
    for o in OPTIONS:
        assert SAMPLES[o.name] != o.default, o.name


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_every_option_reachable_by_flag_and_by_env(
    option: Option, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = option.format(SAMPLES[option.name])
    by_flag = _run_cli([option.flag, text], {}, monkeypatch)
    by_env = _run_cli([], {option.env: text}, monkeypatch)
    assert getattr(by_flag, option.name) == SAMPLES[option.name]
    assert by_env == by_flag == Config().replace(**{option.name: SAMPLES[option.name]})
    assert Config.from_env({option.env: text}) == by_env
    # the flag beats the environment
    default = option.format(option.default)
    assert _run_cli([option.flag, text], {option.env: default}, monkeypatch) == by_flag


def test_config_argv_reproduces_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    config = Config(**SAMPLES)  # type: ignore[arg-type]
    # every option is on the command line, so an inherited variable cannot change it
    env = {o.env: o.format(o.default) for o in OPTIONS}
    assert _run_cli(config_argv(config), env, monkeypatch) == config
    assert config_argv(config, ["listen"]) == ["--listen", "127.0.0.1:1234"]


def test_proxy_help_lists_every_flag_and_variable() -> None:
    from typer.testing import CliRunner

    from sidecar.cli import app

    result = CliRunner().invoke(app, ["proxy", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for o in OPTIONS:
        assert o.flag in result.output, o.name
        assert o.env in result.output, o.name


def test_bad_flag_value_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from sidecar.cli import app

    result = CliRunner().invoke(app, ["proxy", "--max-body", "lots"])
    assert result.exit_code != 0
    assert "--max-body" in result.output


def test_up_takes_every_option_but_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from sidecar.cli import app

    result = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for o in OPTIONS:
        shown = re.search(rf"{o.flag}(?![-\w])", result.output) is not None
        assert shown is (o.name != "upstream"), o.name


def _run_up(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Config:
    """The sidecar config `up` would start its child with (nothing is built or run)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from sidecar.cli import app
    from sidecar.cli import up as up_cli

    seen: list[Config] = []

    class Supervisor:
        def __init__(self, cfg: object, preempt: bool) -> None:
            seen.append(cfg.sidecar)  # type: ignore[attr-defined]

        def run(self, on_ready: object) -> int:
            return 0

    monkeypatch.setattr(up_cli, "Supervisor", Supervisor)
    monkeypatch.setattr(up_cli, "resolve_model", lambda model: Path("/m.gguf"))
    monkeypatch.setattr(up_cli, "server_args_for", lambda path: ())
    monkeypatch.setattr(up_cli, "server_supports", lambda binary, flag: True)
    for o in OPTIONS:
        monkeypatch.delenv(o.env, raising=False)
    result = CliRunner().invoke(app, ["up", "--server-bin", "/bin/sh", *args], env=env)
    assert result.exit_code == 0, result.output
    return seen[0]


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.name != "upstream"],
                         ids=lambda o: o.name)  # fmt: skip
def test_up_passes_every_option_on(option: Option, monkeypatch: pytest.MonkeyPatch) -> None:
    text = option.format(SAMPLES[option.name])
    expected = Config(upstream="http://127.0.0.1:8080").replace(
        **{option.name: SAMPLES[option.name]}
    )
    assert _run_up([option.flag, text], {}, monkeypatch) == expected
    assert _run_up([], {option.env: text}, monkeypatch) == expected


def test_up_drains_as_long_as_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run_up([], {}, monkeypatch).drain_timeout == Config().drain_timeout == 30.0


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), ("true", True), ("Yes", True), ("on", True),
     ("0", False), ("false", False), ("no", False), ("off", False), ("", False)],
)  # fmt: skip
def test_a_switch_takes_one_or_zero_and_their_words(text: str, value: bool) -> None:
    assert Config.from_env({"LLAMA_SIDECAR_UVLOOP": text}).uvloop is value


def test_a_switch_refuses_anything_else() -> None:
    with pytest.raises(ValueError, match="--uvloop / LLAMA_SIDECAR_UVLOOP: not 1 or 0"):
        Config.from_env({"LLAMA_SIDECAR_UVLOOP": "maybe"})


def test_log_level_is_a_level() -> None:
    assert Config(log_level="warning").log_level == "warning"
    with pytest.raises(ValueError, match="log_level"):
        Config(log_level="LOUD")


def test_uvloop_only_when_asked() -> None:
    from sidecar.proxy.server import _use_uvloop

    assert _use_uvloop(Config()) is False
