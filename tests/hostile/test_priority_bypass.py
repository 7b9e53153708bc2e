"""A client that wants another priority than the operator's: every way in, tried.

Once a priority rule is on, every request that llama-server would run as a generation
must get the operator's priority, whatever the spelling of its path, or be refused.  The
attacks: route spellings llama-server still serves as completions, generating routes off
the old list, bodies the old rewrite could not parse but llama-server can, a multipart
form, a compressed body, the prediction route that dispatches from inside its body.

Three layers: a scripted upstream shows what the sidecar forwards (exact bytes); the
route table of the pinned llama-server source shows that :mod:`sidecar.core.routes` knows
every route (a new one fails here until it is classified); the real patched server, with
a park forced every few tokens, shows from its own counters that no attack ran at a
priority above the operator's.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from sidecar.core.routes import GENERATING_ROUTES, OTHER_POST_ROUTES
from sidecar.paths import cache_dir
from sidecar.proxy.server import Sidecar
from tests.conftest import REPO
from tests.support.fake_upstream import FakeUpstream, fake_upstream_in_thread
from tests.support.fixtures import SidecarFactory
from tests.support.llama import LlamaServer
from tests.support.nginx import NGINX, start_nginx
from tests.support.rawclient import RawConn
from tests.support.sidecar import ephemeral_config, run_in_thread

OPERATOR = -100  # the priority every client gets (--priority-default)
RULE = {"priority_default": OPERATOR}
WANTED = 1_000_000  # what the attacker asks for

PROMPT = {"prompt": "hello there", "n_predict": 8, "ignore_eos": True, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
        "ignore_eos": True, "temperature": 0}  # fmt: skip


def body(fields: dict[str, object], **more: object) -> bytes:
    return json.dumps({**fields, **more, "priority": WANTED}).encode()


DEEP = 2000
DEEP_BODY = body(PROMPT)[:-1] + b',"x":' + b"[" * DEEP + b"]" * DEEP + b"}"
MULTIPART = (b"--b\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nhello\r\n"
             b"--b--\r\n")  # fmt: skip

# (name, target, extra head lines, body): refused by the sidecar, never forwarded
REFUSED = [
    ("completion%73", b"/v1/chat/completion%73", b"", body(CHAT)),
    ("chat%2F", b"/v1/chat%2Fcompletions", b"", body(CHAT)),
    ("fragment", b"/v1/chat/completions#x", b"", body(CHAT)),
    ("%u-escape", b"/completio%u006e", b"", body(PROMPT)),
    ("absolute-form", b"http://x/completion", b"", body(PROMPT)),
    ("NUL after the object", b"/completion", b"", body(PROMPT) + b"\x00"),
    ("NUL, then the wanted field", b"/completion", b"",
     json.dumps(PROMPT).encode() + b'\x00{"priority":1000000}'),
    ("multipart form", b"/completion", b"Content-Type: multipart/form-data; boundary=b\r\n",
     MULTIPART),
    ("content-encoding", b"/completion", b"Content-Encoding: gzip\r\n", body(PROMPT)),
    ("prediction route", b"/predict", b"",
     json.dumps({"instances": [{"@requestFormat": "completion", **PROMPT,
                                "priority": WANTED}]}).encode()),
    ("array", b"/completion", b"", b"[" + body(PROMPT) + b"]"),
    # llama-server's Anthropic conversion keeps only the fields it knows: the priority is lost
    ("messages", b"/v1/messages", b"", body(CHAT)),
]  # fmt: skip

# (name, target, body): forwarded with the operator's priority as the object's last member
SPLICED = [
    ("responses", b"/v1/responses",
     body({"input": "hello", "max_output_tokens": 16, "temperature": 0})),
    ("depth 2000", b"/completion", DEEP_BODY),
    ("escaped key", b"/completion",
     json.dumps(PROMPT).encode()[:-1] + b',"pri\\u006frity":1000000}'),
    ("key in a nested object too", b"/v1/chat/completions",
     body(CHAT, metadata={"priority": WANTED})),
]  # fmt: skip


def request(target: bytes, head: bytes, data: bytes) -> bytes:
    return (b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + head + b"Content-Length: %d\r\n\r\n" % len(data) + data)  # fmt: skip


# --------------------------------------------------------------- a scripted upstream


@pytest.mark.anyio
@pytest.mark.in_memory
@pytest.mark.parametrize(("name", "target", "head", "data"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_an_attack_the_priority_cannot_reach_is_refused(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, name: str, target: bytes, head: bytes,
    data: bytes,
) -> None:  # fmt: skip
    async with sidecar_factory(fake.url, **RULE) as sc, await RawConn.open(sc.url) as c:
        await c.send(request(target, head.replace(b"Content-Type: application/json\r\n", b""),
                             data))  # fmt: skip
        resp = await c.read_response()
    assert resp.status in (400, 403, 415), (resp.status, resp.body[:200])
    assert b"priority rule" in resp.body
    assert [r.target for r in fake.requests if r.method == b"POST"] == []


@pytest.mark.anyio
@pytest.mark.in_memory
@pytest.mark.parametrize(("name", "target", "data"), SPLICED, ids=[r[0] for r in SPLICED])
async def test_a_generating_request_gets_the_operators_priority_last(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, name: str, target: bytes, data: bytes
) -> None:
    async with sidecar_factory(fake.url, **RULE) as sc, await RawConn.open(sc.url) as c:
        await c.send(request(target, b"", data))
        resp = await c.read_response()
    assert resp.status == 200
    [got] = [r for r in fake.requests if r.method == b"POST"]
    assert got.target == target
    assert got.body == data[:-1] + b',"priority":%d}' % OPERATOR
    # the last of duplicate keys wins in llama-server's parser (and in Python's)
    if name != "depth 2000":
        assert json.loads(got.body)["priority"] == OPERATOR


@pytest.mark.anyio
@pytest.mark.in_memory
async def test_routes_that_do_not_generate_are_relayed_untouched(
    fake: FakeUpstream, sidecar_factory: SidecarFactory
) -> None:
    raw = b'{"content":"hi","priority":1000000}\x00 anything'
    async with sidecar_factory(fake.url, **RULE) as sc:
        for target in (b"/tokenize", b"/v1/embeddings", b"/slots/0?action=save"):
            async with await RawConn.open(sc.url) as c:
                await c.send(request(target, b"", raw))
                assert (await c.read_response()).status == 200
    assert [r.body for r in fake.requests if r.method == b"POST"] == [raw] * 3


@pytest.mark.nginx
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)")
def test_through_nginx_with_the_documented_config_too(tmp_path: Path) -> None:
    """docs/nginx.conf in front: whatever nginx makes of each attack (it may refuse one
    itself, or rewrite an absolute-form target into a path), what reaches upstream carries
    the operator's priority as its last member, and nothing else does."""
    with fake_upstream_in_thread() as fake, run_in_thread(ephemeral_config(fake.url, **RULE)) as sc:
        nginx = start_nginx(tmp_path, urlsplit(sc.url).port or 0)
        try:
            got = {name: send(nginx.url, request(target, head, data))[0]
                   for name, target, head, data in
                   [*REFUSED, *((n, t, b"", d) for n, t, d in SPLICED)]}  # fmt: skip
        finally:
            nginx.stop()
        bodies = [r.body for r in fake.requests if r.method == b"POST"]
    assert all(b.endswith(b',"priority":%d}' % OPERATOR) for b in bodies), bodies
    assert len(bodies) == sum(status == 200 for status in got.values()), got
    assert all(got[name] == 200 for name, _, _ in SPLICED), got
    assert sum(status >= 400 for status in got.values()) >= len(REFUSED) - 1, got


# ------------------------------------------------------ llama-server's own route table


def pinned_source() -> Path:
    env = (REPO / "server_patch" / "upstream.env").read_text()
    sha = re.search(r"^SDIST_SHA256=([0-9a-f]{64})$", env, re.M)
    assert sha is not None, "server_patch/upstream.env names no SDIST_SHA256"
    src = cache_dir() / "src" / f"llama.cpp-{sha.group(1)[:16]}"
    if not (src / "tools" / "server" / "server.cpp").is_file():
        pytest.skip(f"the pinned llama.cpp source is not there ({src}): ./build_llama.sh "
                    f"--print-path fetches it with the first build")  # fmt: skip
    return src


REGISTRATION = re.compile(
    r'ctx_http\.(get|post|del)\s*\(\s*"([^"]+)"\s*,\s*ex_wrapper\(\s*([\w.>-]+)\s*\)\s*\)'
)
GENERATES = re.compile(r"handle_completions_impl|SERVER_TASK_TYPE_(?:COMPLETION|INFILL)\b")


def route_table(src: Path) -> list[tuple[str, str, bool]]:
    """``(method, path, generates)`` for each route llama-server registers, with the patch
    series' added lines; a handler generates if its body starts a completion task."""
    server = (src / "tools" / "server" / "server.cpp").read_text()
    added = "\n".join(line[1:] for p in sorted((REPO / "server_patch").glob("*.patch"))
                      for line in p.read_text().splitlines() if line.startswith("+"))  # fmt: skip
    context = (src / "tools" / "server" / "server-context.cpp").read_text()
    handlers = dict(re.findall(r"\n    this->(\w+) = \[[^\n]*\n(.*?)\n    };", context, re.S))
    table = []
    for method, path, handler in REGISTRATION.findall(server + "\n" + added):
        name = handler.removeprefix("routes.")
        if handler.startswith("routes."):
            assert name in handlers, f"no body found for {handler} in server-context.cpp"
        table.append((method, path, bool(GENERATES.search(handlers.get(name, "")))))
    return table


def test_the_route_list_is_llama_servers_route_table() -> None:
    table = route_table(pinned_source())
    assert len(table) >= 40, f"only {len(table)} registrations found: has the syntax changed?"
    post = {p.encode() for m, p, _ in table if m == "post"}
    generating = {p.encode() for m, p, gen in table if gen}
    assert generating, "no generating handler found: has handle_completions_impl been renamed?"
    assert all(m == "post" for m, _, gen in table if gen), "a generating route that is not POST"
    assert generating == GENERATING_ROUTES, (
        f"generating routes not in sidecar/core/routes.py: "
        f"{sorted(generating - GENERATING_ROUTES)}; "
        f"listed but not generating: {sorted(GENERATING_ROUTES - generating)}")  # fmt: skip
    assert post - generating == OTHER_POST_ROUTES, (
        f"POST routes sidecar/core/routes.py does not classify: {sorted(post - generating - OTHER_POST_ROUTES)}; "  # noqa: E501
        f"listed but not registered: {sorted(OTHER_POST_ROUTES - post)}")  # fmt: skip


# --------------------------------------------------------------- the real server

# a park every 2 tokens, so every request that generates is parked and counted by the
# class of its priority: low (< 0), normal (0), high (> 0)
FORCED_PARKS = {"LLAMA_SERVER_PREEMPT_EVERY": "2"}
SERVER_ARGS = ["--kv-unified", "--metrics", "--slots", "-t", "1", "-tb", "1", "--no-warmup",
               "--preempt-ram", "1024", "-c", "512", "-np", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def forced_parks_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One server for the module's real-server tests: each diffs the counters around each
    request it sends."""
    srv = LlamaServer(llama_server_bin, tiny_model, SERVER_ARGS, FORCED_PARKS,
                      log_path=tmp_path_factory.mktemp("bypass") / "llama-server.log")  # fmt: skip
    srv.start()
    yield srv
    srv.stop()


def parks_by_class(url: str) -> dict[str, float]:
    from tests.server.preempt_helpers import metrics

    m = metrics(url)
    return {c: m[f"n_preempt_priority_{c}_total"] for c in ("low", "normal", "high")}


def send(url: str, raw: bytes) -> tuple[int, bytes]:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=120) as s:
        s.sendall(raw.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1))
        got = b""
        while data := s.recv(65536):
            got += data
    return int(got.split(b" ", 2)[1]), got


@pytest.mark.server
@pytest.mark.slow
def test_no_attack_runs_above_the_operators_priority_on_the_real_server(
    forced_parks_server: LlamaServer,
) -> None:
    srv = forced_parks_server
    config = ephemeral_config(srv.url, **RULE)
    ran: dict[str, tuple[int, dict[str, float]]] = {}
    sidecar: Sidecar
    with run_in_thread(config) as sidecar:
        attacks = [(n, t, h, d) for n, t, h, d in REFUSED] + [(n, t, b"", d) for n, t, d in SPLICED]
        for name, target, head, data in attacks:
            before = parks_by_class(srv.url)
            status, _ = send(sidecar.url, request(target, head, data))
            after = parks_by_class(srv.url)
            ran[name] = (status, {c: after[c] - before[c] for c in after})
        # and a plain request, to show the counters count
        status, _ = send(sidecar.url, request(b"/completion", b"", body(PROMPT)))
        plain = parks_by_class(srv.url)
    above = {n: r for n, r in ran.items() if r[1]["normal"] or r[1]["high"]}
    assert not above, f"ran above the operator's priority: {above}"
    assert status == 200
    assert plain["low"] > 0, plain
    # the spliced ones generated, parked at the operator's (low) priority; the refused ones
    # never reached llama-server
    for name, _, _ in SPLICED:
        assert ran[name][0] == 200, (name, ran[name])
        assert ran[name][1]["low"] > 0, (name, ran[name])
    for name, *_ in REFUSED:
        assert ran[name][0] in (400, 403, 415), (name, ran[name])
        assert not any(ran[name][1].values()), (name, ran[name])
    assert srv.alive()


# A body per generating route, asking for another priority; a route added to
# GENERATING_ROUTES fails the test below until it has one here or a reason it cannot.
RESPONSES = {"input": "hello", "max_output_tokens": 16, "temperature": 0}
ROUTE_BODIES = {
    "/completion": PROMPT, "/completions": PROMPT, "/v1/completions": PROMPT,
    "/chat/completions": CHAT, "/v1/chat/completions": CHAT,
    "/responses": RESPONSES, "/v1/responses": RESPONSES,
}  # fmt: skip
NOT_SENT = {
    "/infill": "the test model has no fill-in-the-middle tokens (llama-server refuses it)",
    "/audio/transcriptions": "multipart forms only: refused while a rule is on",
    "/v1/audio/transcriptions": "multipart forms only: refused while a rule is on",
    "/v1/messages": "refused while a rule is on (PRIORITY_DROPPED)",
}


@pytest.mark.server
@pytest.mark.slow
def test_every_generating_route_runs_at_the_operators_priority_on_the_real_server(
    forced_parks_server: LlamaServer,
) -> None:
    """The spliced field reaches the task on each route: llama-server's conversions keep it
    (a conversion that rebuilt the body would park the request as 'normal' here)."""
    assert {r.encode() for r in [*ROUTE_BODIES, *NOT_SENT]} == GENERATING_ROUTES
    srv = forced_parks_server
    ran = {}
    with run_in_thread(ephemeral_config(srv.url, **RULE)) as sidecar:
        for route, fields in ROUTE_BODIES.items():
            before = parks_by_class(srv.url)
            status, _ = send(sidecar.url, request(route.encode(), b"", body(fields)))
            after = parks_by_class(srv.url)
            ran[route] = (status, {c: after[c] - before[c] for c in after})
    wrong = {r: got for r, got in ran.items()
             if got[0] != 200 or got[1]["low"] == 0 or got[1]["normal"] or got[1]["high"]}
    assert not wrong, f"not run at the operator's priority: {wrong}"  # fmt: skip
