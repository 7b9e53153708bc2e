"""`probe` against a model without a chat template says so, and (given a bare URL) probes
/completion instead of streaming ChatML markers from the chat endpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from sidecar.cli import app
from sidecar.ops.probe import FALLBACK_CHATML, has_chat_template
from tests.support.fake_upstream import (
    FakeUpstream,
    RequestRecord,
    Script,
    fake_upstream_in_thread,
    json_response,
)

SSE = b"text/event-stream"
OWN_TEMPLATE = "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"


def sse_body(events: list[dict[str, object]], done: bool) -> bytes:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


class FakeServer:
    """/props with ``template`` (None: 404), a /completion and a ChatML-leaking chat stream."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.fake = fake
        self.template: str | None = None
        completion = [{"content": "Hi", "stop": False}, {"content": "!", "stop": True}]
        chat = [{"choices": [{"index": 0, "delta": {"content": "<|im_start|>"}}]}]
        fake.route("/props", self._props)
        fake.route("/completion", json_response(200, sse_body(completion, False), SSE))
        fake.route("/v1/chat/completions", json_response(200, sse_body(chat, True), SSE))

    def _props(self, _: RequestRecord) -> Script:
        if self.template is None:
            return json_response(404, {"error": "not found"})
        return json_response(200, {"chat_template": self.template})

    @property
    def paths(self) -> list[str]:
        """The paths POSTed to, in order."""
        return [r.target.decode() for r in self.fake.requests if r.method == b"POST"]


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    with fake_upstream_in_thread() as upstream:
        yield FakeServer(upstream)


def url_of(srv: FakeServer) -> str:
    return srv.fake.url


def probe(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, ["probe", *args, "-n", "1", "-t", "2", "--quiet"])
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize(
    ("template", "expected"), [(FALLBACK_CHATML, False), (OWN_TEMPLATE, True), (None, None)]
)
def test_has_chat_template(fake: FakeServer, template: str | None, expected: bool | None) -> None:
    fake.template = template
    assert has_chat_template(url_of(fake)) is expected
    assert has_chat_template(url_of(fake) + "/v1/chat/completions") is expected


def test_no_template_bare_url_probes_completion_and_says_why(fake: FakeServer) -> None:
    fake.template = FALLBACK_CHATML
    code, _, err = probe(url_of(fake))
    assert code == 0, err
    assert "no chat template" in err
    assert "/completion instead" in err
    assert fake.paths == ["/completion"]


def test_no_template_explicit_chat_endpoint_warns_and_runs_it(fake: FakeServer) -> None:
    fake.template = FALLBACK_CHATML
    code, _, err = probe(url_of(fake) + "/v1/chat/completions")
    assert code == 0, err
    assert "warning" in err
    assert "no chat template" in err
    assert fake.paths == ["/v1/chat/completions"]


@pytest.mark.parametrize("template", [OWN_TEMPLATE, None])
def test_model_with_a_template_or_no_props_is_probed_on_chat(
    fake: FakeServer, template: str | None
) -> None:
    fake.template = template
    code, _, err = probe(url_of(fake))
    assert code == 0, err
    assert "chat template" not in err
    assert fake.paths == ["/v1/chat/completions"]
