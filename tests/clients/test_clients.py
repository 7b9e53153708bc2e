"""The SSE clients people use, through a real park: client -> nginx (docs/nginx.conf, its
read timeout shorter than the park) -> sidecar -> patched llama-server.

Each test runs one client on two concurrent chat streams beside an endless resident
(tests/support/resident.py): a stream straight to llama-server that outranks them and never
ends, so one of the client's own streams is parked for as long as the test lets the resident
run, on a model of any speed; it is cut once the park has outlasted nginx's read timeout.
Every stream must end normally with the full text (the same text as a solo, unstreamed
request: the generated model decodes greedily the same way in any batch), no error, and none
of the sidecar's or llama-server's comment lines (`: keepalive`, `: preempted`, ...) in the
text. The Node clients (the openai SDK,
eventsource-parser) are pinned in package-lock.json here and installed with `npm ci`; their
tests skip only when node or npm is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.ops.supervise import server_supports
from tests.support.nginx import NGINX, Nginx, start_nginx
from tests.support.resident import Resident, endless_resident
from tests.support.up import UpProcess

pytestmark = [
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.nginx,
    # the pair must overlap the resident: beside two other workers at a cold start the pair
    # once ran without a park (3 Dec 2026)
    pytest.mark.serial,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)"),
]

HERE = Path(__file__).resolve().parent
NODE, NPM = shutil.which("node"), shutil.which("npm")
# A 256-cell pool and three slots: one per stream of the pair and one for the resident. A chat
# is 165 prompt tokens (ChatML-wrapped), so the second waits for the first (parked with 0
# cells); the resident's 64 fit beside one chat, and with both generating the chat is parked
# ~10 tokens into its reply, holding ~175 cells. It cannot come back beside the resident, which
# only grows (a context shift leaves it 129 of the 256), until the test cuts the resident.
# Short replies stay on the solo reply's text (long ones drift by batch-shape float noise, see
# docs/benchmarks.md).
POOL_CELLS = 256
POOL = ("--parallel", "3", "--ctx-size", str(POOL_CELLS), "--preempt-ram", "8192")
TOKENS = 20
PROMPT = (
    "Once upon a time, in a lighthouse at the edge of a cold grey sea, there lived a keeper "
    "who wrote down every ship that passed. Tell me the rest."
)
STREAMS = 2
COMMENT_WORDS = ("keepalive", "preempt", "resumed", "recomputed")
# nginx's proxy_read_timeout, s: the sidecar's keepalives come eight times per timeout, and the
# resident is cut once a park has lasted half as long again.
READ_TIMEOUT_S = 1.0
KEEPALIVE_S = 0.125
HOLD_S = 1.5 * READ_TIMEOUT_S


@dataclass
class Stack:
    up: UpProcess
    nginx: Nginx
    reference: str  # the text of a solo, unstreamed request straight to llama-server
    read_timeout: float  # nginx's proxy_read_timeout, s

    def resident(self) -> AbstractContextManager[Resident]:
        """The endless resident, cut once a park has lasted HOLD_S; first the chats' prompt is
        put in a slot's cache, so the first chat's head comes at its first token (a cold
        prefill of 165 tokens can outlast nginx's read timeout on a loaded machine)."""
        body = {**chat_body(False), "max_tokens": 1}
        r = httpx.post(self.up.server_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return endless_resident(self.up.server_url, self.up.server_log, HOLD_S)

    def parks(self) -> list[float]:
        """Park lengths so far, from llama-server's log (`resumed after X s`)."""
        text = self.up.server_log.read_text(errors="replace")
        return [float(x) for x in re.findall(r"resumed after ([0-9.]+) s", text)]


def chat_body(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT}],
                            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                            "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path, slow_model: Path
) -> Iterator[Stack]:
    if not server_supports(llama_server_bin, "--preempt-ram"):
        pytest.fail(f"{llama_server_bin} has no --preempt-ram (not the patched build?)")
    tmp = tmp_path_factory.mktemp("clients")
    env = {"LLAMA_SIDECAR_PARK_KEEPALIVE": f"{KEEPALIVE_S:g}",
           "LLAMA_SIDECAR_IDLE_KEEPALIVE": f"{KEEPALIVE_S:g}"}  # fmt: skip
    up = UpProcess(["--server-bin", str(llama_server_bin), "--model", str(slow_model), *POOL,
                    "--ping-interval", "-1", "--", "-t", "1", "--context-shift"], tmp / "up",
                   env=env)  # fmt: skip
    up.log_dir.mkdir(parents=True)
    up.start(timeout=240)
    nginx: Nginx | None = None
    try:
        r = httpx.post(up.server_url + "/v1/chat/completions", json=chat_body(False), timeout=300)
        assert r.status_code == 200, r.text
        reference = r.json()["choices"][0]["message"]["content"]
        assert reference
        nginx = start_nginx(tmp / "nginx", up.port, read_timeout=f"{READ_TIMEOUT_S:g}s")
        yield Stack(up, nginx, reference, READ_TIMEOUT_S)
    finally:
        if nginx is not None:
            nginx.stop()
        up.kill()


Result = dict[str, Any]


def run_pair(one: Callable[[str], Result], url: str) -> list[Result]:
    """`one(url)` in STREAMS threads at once; a raised exception becomes the stream's error."""
    results: list[Result] = [{"error": "did not finish"} for _ in range(STREAMS)]

    def run(i: int) -> None:
        try:
            results[i] = one(url)
        except Exception as e:  # reported by the assertions
            results[i] = {"error": repr(e)}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    return results


def check(stack: Stack, results: list[Result], parks_before: int) -> None:
    assert len(results) == STREAMS
    for res in results:
        assert res.get("error") is None, (res.get("error"), stack.nginx.error_log())
        assert res["finish_reason"] == "length", res
        assert res["completion_tokens"] == TOKENS, res
        text = res["text"]
        assert not any(w in text for w in COMMENT_WORDS), f"comment text in the content: {text!r}"
        assert text == stack.reference, "the streamed text differs from the solo reply"
    new_parks = stack.parks()[parks_before:]
    assert new_parks, "no stream was parked: the pair did not overflow the pool"
    assert max(new_parks) > stack.read_timeout, (
        f"parks {new_parks} were not longer than nginx's timeout of {stack.read_timeout} s"
    )
    assert "upstream timed out" not in stack.nginx.error_log()


def accumulate(res: Result, chunk: dict[str, Any]) -> None:
    """Fold one decoded chat.completion.chunk into a result."""
    if "error" in chunk:
        raise RuntimeError(f"error event: {chunk}")
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if isinstance(content, str):
            res["text"] += content
        if choice.get("finish_reason"):
            res["finish_reason"] = choice["finish_reason"]
    if chunk.get("usage"):
        res["completion_tokens"] = chunk["usage"]["completion_tokens"]


def new_result() -> Result:
    return {"text": "", "finish_reason": None, "completion_tokens": None, "error": None}


# ---- Python clients --------------------------------------------------------------------------


def test_openai_python_sdk(stack: Stack) -> None:
    from openai import OpenAI

    def one(url: str) -> Result:
        res = new_result()
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        body = chat_body(True)
        stream = client.chat.completions.create(
            model="served", messages=body["messages"], max_tokens=TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        with stream:
            for chunk in stream:
                accumulate(res, chunk.model_dump(exclude_none=True))
        return res

    before = len(stack.parks())
    with stack.resident():
        results = run_pair(one, stack.nginx.url)
    check(stack, results, before)


def test_httpx_sse(stack: Stack) -> None:
    from httpx_sse import connect_sse

    def one(url: str) -> Result:
        res = new_result()
        with httpx.Client(timeout=httpx.Timeout(600, connect=10)) as client, connect_sse(
            client, "POST", url + "/v1/chat/completions", json=chat_body(True)
        ) as source:
            source.response.raise_for_status()
            for event in source.iter_sse():
                if event.data == "[DONE]":
                    break
                accumulate(res, json.loads(event.data))
        return res

    before = len(stack.parks())
    with stack.resident():
        results = run_pair(one, stack.nginx.url)
    check(stack, results, before)


def test_sseclient_py(stack: Stack) -> None:
    import sseclient

    def one(url: str) -> Result:
        res = new_result()
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat_body(True),
                          timeout=httpx.Timeout(600, connect=10)) as r:  # fmt: skip
            r.raise_for_status()
            for event in sseclient.SSEClient(r.iter_bytes()).events():
                if event.data == "[DONE]":
                    break
                accumulate(res, json.loads(event.data))
        return res

    before = len(stack.parks())
    with stack.resident():
        results = run_pair(one, stack.nginx.url)
    check(stack, results, before)


# ---- Node clients ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """`npm ci` the pinned clients (once; again when package-lock.json changes)."""
    if NODE is None or NPM is None:
        pytest.skip("node and npm are not installed (apt-get install nodejs npm)")
    stamp = HERE / "node_modules" / ".package-lock.json"
    lock = HERE / "package-lock.json"
    if not stamp.exists() or stamp.stat().st_mtime < lock.stat().st_mtime:
        proc = subprocess.run([NPM, "ci", "--no-audit", "--no-fund"], cwd=HERE,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, f"npm ci failed:\n{proc.stdout}\n{proc.stderr}"
    return HERE / "node_modules"


def run_node(script: str, url: str) -> list[Result]:
    assert NODE is not None
    proc = subprocess.run([NODE, str(HERE / script), url, str(STREAMS), str(TOKENS), PROMPT],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: list[Result] = json.loads(proc.stdout)
    return results


def test_openai_node_sdk(stack: Stack, node_modules: Path) -> None:
    before = len(stack.parks())
    with stack.resident():
        results = run_node("openai_stream.mjs", stack.nginx.url)
    check(stack, results, before)


def test_eventsource_parser(stack: Stack, node_modules: Path) -> None:
    before = len(stack.parks())
    with stack.resident():
        results = run_node("eventsource_parser_stream.mjs", stack.nginx.url)
    check(stack, results, before)
    assert all(res["done"] for res in results), results
    # The park was announced, and the parser reported the comments apart from the data.
    assert any(any("preempted" in c for c in res["comments"]) for res in results), [
        r["comments"][:10] for r in results
    ]
