"""`up`'s banner starts with the chat page's address when llama-server serves its web UI, and
says plainly that there is none (the API works) when it does not."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sidecar.cli.up import _ready_banner, has_page
from sidecar.config import Config
from sidecar.ops.supervise import UpConfig


class _Handler(BaseHTTPRequestHandler):
    page = True

    def do_GET(self) -> None:
        if self.path == "/" and self.page:
            body, ctype, status = b"<!doctype html><title>llama</title>", "text/html", 200
        else:
            body, ctype, status = b'{"error":"File Not Found"}', "application/json", 404
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(params=[True, False], ids=["with-ui", "without-ui"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    handler = type("H", (_Handler,), {"page": request.param})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", request.param
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_banner_leads_with_the_page_or_says_there_is_none(
    server: tuple[str, bool], tmp_path: Path
) -> None:
    url, with_ui = server
    assert has_page(url) is with_ui
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    sidecar = Config(listen="127.0.0.1:18081")
    cfg = UpConfig(server_bin=Path("/bin/llama-server"), model=model, sidecar=sidecar)
    lines = _ready_banner(cfg, True, has_page(url)).splitlines()
    first = lines[lines.index("llama-sidecar is up") + 1]
    if with_ui:
        assert first == "  open http://127.0.0.1:18081/ in a browser (the chat page)"
    else:
        assert first.startswith("  no chat page:")
        assert "the API below works" in first
    assert lines[lines.index("llama-sidecar is up") + 2].startswith("  API (through the sidecar)")


def test_no_server_means_no_page() -> None:
    assert has_page("http://127.0.0.1:9") is False
