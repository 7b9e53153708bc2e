"""With --api-key, llama-server's web UI still loads: its page and static files pass without
the key (llama-server serves them the same way with its own --api-key), the page then asks for
the key itself, and every API route still needs it, whatever a client dresses it up as."""

from __future__ import annotations

import pytest

from sidecar.proxy.request import public_route
from tests.support.fake_upstream import FakeUpstream
from tests.support.fixtures import SidecarFactory
from tests.support.memnet import http_client

UI_FILES = [
    b"/", b"/?lang=en", b"/index.html", b"/sw.js", b"/manifest.webmanifest", b"/build.json",
    b"/favicon.ico", b"/pwa-192x192.png", b"/workbox-5a1b2c3d.js",
    b"/_app/version.json", b"/_app/immutable/bundle.Dx1_a-9.js",
    b"/_app/immutable/assets/bundle.B2c3.css",
]  # fmt: skip
API_ROUTES = [
    b"/props", b"/slots", b"/metrics", b"/models", b"/v1/models", b"/v1/chat/completions",
    b"/completion", b"/tokenize", b"/lora-adapters", b"/v1/stream/lookup",
]  # fmt: skip
DISGUISED = [
    b"/_app/../props", b"/_app/immutable/../../slots", b"/index.html/../metrics",
    b"/%70rops", b"/_app/%2e%2e/props", b"//props", b"/props/", b"/.env", b"/_app",
    b"/props?x=index.html", b"/v1/models#a.js", b"/a.js/../../slots",
]  # fmt: skip


@pytest.mark.parametrize("target", UI_FILES)
def test_the_ui_files_are_public_for_get_and_head(target: bytes) -> None:
    assert public_route(b"GET", target)
    assert public_route(b"HEAD", target)


@pytest.mark.parametrize("target", UI_FILES)
def test_other_methods_on_the_ui_files_need_the_key(target: bytes) -> None:
    for method in (b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"):
        assert not public_route(method, target)


@pytest.mark.parametrize("target", API_ROUTES + DISGUISED)
def test_api_routes_need_the_key_however_they_are_written(target: bytes) -> None:
    assert not public_route(b"GET", target)
    assert not public_route(b"POST", target)


def test_health_stays_public() -> None:
    assert public_route(b"GET", b"/health")
    assert public_route(b"GET", b"/v1/health")


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_the_page_passes_without_the_key_and_the_api_does_not(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    page = b"<!doctype html><title>llama</title>"
    head = [(b"Content-Type", b"text/html"), (b"Content-Length", str(len(page)).encode())]
    fake.route("/", [("head", 200, head), ("send", page), ("end",)])
    async with sidecar_factory(fake.url, api_key="s3cret") as sc, http_client() as c:
        r = await c.get(sc.url + "/")
        assert r.status_code == 200
        assert r.content == page
        for target in ("/props", "/_app/../props", "/%70rops"):
            r = await c.get(sc.url + target)
            assert r.status_code == 401, target
            assert r.json()["error"]["type"] == "authentication_error"
        r = await c.post(sc.url + "/", content=b"x")
        assert r.status_code == 401
    assert [req.target for req in fake.requests] == [b"/"]
