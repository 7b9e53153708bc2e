"""`probe` against a model without a chat template says so, and (given a bare URL) probes
/completion instead of streaming ChatML markers from the chat endpoint."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from sidecar.cli import app
from sidecar.probe import FALLBACK_CHATML, has_chat_template

OWN_TEMPLATE = "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"


class FakeServer(ThreadingHTTPServer):
    template: str | None = None  # None: no /props (404)
    paths: list[str]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/props" and self.server.template is not None:
            self._send(200, json.dumps({"chat_template": self.server.template}).encode(),
                       "application/json")  # fmt: skip
        else:
            self._send(404, b'{"error": "not found"}', "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.paths.append(self.path)
        if self.path == "/completion":
            events = [{"content": "Hi", "stop": False}, {"content": "!", "stop": True}]
        else:
            events = [{"choices": [{"index": 0, "delta": {"content": "<|im_start|>"}}]}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        if self.path != "/completion":
            body += "data: [DONE]\n\n"
        self._send(200, body.encode(), "text/event-stream")


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    srv = FakeServer(("127.0.0.1", 0), Handler)
    srv.paths = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url_of(srv: FakeServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


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
