"""The sidecar sets the operator's request priority on JSON completion bodies."""

from __future__ import annotations

import json

import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.fixtures import SidecarFactory
from tests.support.memnet import http_client

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

RULES = {"priority_keys": "gold=10,batch=-5", "priority_header": "X-Priority"}
ROUTES = ["/completion", "/v1/completions", "/v1/chat/completions"]


def sent(fake: FakeUpstream) -> list[bytes]:
    """The bodies upstream received on completion requests (the readiness poll aside)."""
    return [r.body for r in fake.requests if r.method == b"POST"]


async def test_priority_from_key_header_or_default(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    for route in [*ROUTES, "/tokenize"]:
        fake.route(route, [("echo",)])
    async with sidecar_factory(fake.url, **RULES) as sc, http_client() as c:
        cases = [
            ({"Authorization": "Bearer gold", "X-Priority": "-3"}, 10),  # the key wins
            ({"X-Api-Key": "batch"}, -5),
            ({"X-Priority": "7"}, 7),  # the trusted header
            ({"X-Priority": "urgent"}, 0),  # malformed: the default
            ({}, 0),
        ]
        for route in ROUTES:
            for headers, want in cases:
                body = {"prompt": "hi", "n_predict": 1, "priority": 99}  # the client's own: lost
                r = await c.post(sc.url + route, json=body, headers=headers)
                assert r.status_code == 200
                got = json.loads(r.content)
                assert got == {**body, "priority": want}, (route, headers)
        # other routes and methods are relayed untouched
        raw = b'{"content": "hi", "priority": 99}'
        r = await c.post(sc.url + "/tokenize", content=raw, headers={"X-Priority": "3"})
        assert r.content == raw
        metrics = (await c.get(sc.metrics_url or "")).text
    assert f'llama_sidecar_priority_requests_total{{outcome="set"}} {3 * len(cases)}.0' in metrics


async def test_a_body_that_is_not_a_json_object_is_refused_and_counted(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/completion", [("echo",)])
    async with sidecar_factory(fake.url, **RULES) as sc, http_client() as c:
        for raw in (b"not json", b"[1, 2]", b'{"prompt": "cut'):
            r = await c.post(sc.url + "/completion", content=raw, headers={"X-Priority": "3"})
            assert r.status_code == 400
            assert "JSON object" in r.json()["error"]["message"]
        metrics = (await c.get(sc.metrics_url or "")).text
    assert 'llama_sidecar_priority_requests_total{outcome="refused"} 3.0' in metrics
    assert sent(fake) == []


async def test_without_rules_bodies_are_untouched(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/completion", [("echo",)])
    raw = b'{"prompt": "hi",  "priority": 99}'
    async with sidecar_factory(fake.url) as sc, http_client() as c:
        r = await c.post(sc.url + "/completion", content=raw, headers={"X-Priority": "3"})
    assert r.content == raw


async def test_a_large_body_is_rewritten_too(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    fake.route("/completion", [("echo",)])
    prompt = "word " * 200_000  # 1 MB: spliced in steps
    async with sidecar_factory(fake.url, **RULES) as sc, http_client(timeout=30) as c:
        r = await c.post(sc.url + "/completion", json={"prompt": prompt},
                         headers={"Authorization": "Bearer batch"})  # fmt: skip
    assert json.loads(r.content) == {"prompt": prompt, "priority": -5}
