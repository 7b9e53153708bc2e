"""llama-server's own chat page, served through the sidecar, in a real (headless) browser.

`llama-sidecar up` runs the patched build (with its web UI, patched to show parks) and the
generated "slow" model (greedy: `--temp 0`; tens of tokens per second, so parks last
seconds); Chromium opens the page, types a message, sends
it, and the test watches what a person would see. A script added to every page before the
UI loads records, from the DOM, each time the pause notice appears (and its text) and
whether a "Reconnecting" status ever showed, and keeps a copy of every chat stream the page
reads (the request body and the bytes, comments included): the final `"preempt"` record
says whether the server parked that chat, and the body is replayed, unstreamed, against a
llama-server without parks for the reference text. The text the page stored is compared
with that reference. A park can end within milliseconds, before the page renders anything:
what the page must show for every pause, however short, is the note the reply keeps once it
is over ("Paused 5 ms, waiting for memory."), which counts them; the live notice shows only
while a pause lasts long enough to be drawn.

* one chat with forced parks (`LLAMA_SERVER_PREEMPT_EVERY`) and a larger request beside it
  that leaves it no room for a while: the notice showed while parked, is gone at the end,
  and the text is the unparked one;
* four chats in four tabs at once on a pool that fits about two: 4/4 finish with no error,
  every chat the server parked (or queued) keeps a note counting its pauses, none other has
  one or showed the notice, no "Reconnecting", and `/metrics` agrees with the chats' records;
* the same four chats through nginx (docs/nginx.conf) whose read timeout is shorter than
  the parks;
* `--api-key`: the page loads, asks for the key with its own prompt, and chats with it.

Screenshots of the paused page go to the test's artifacts (see conftest.py).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.cli.up import has_page
from tests.support.llama import TEST_KNOB_PREFIX, LlamaServer
from tests.support.nginx import NGINX, Nginx, start_nginx
from tests.support.procs import wait_until
from tests.support.sse_client import StreamLog, stream_sse
from tests.support.up import UpProcess

# Not serial: the parks are sized in the model's steps and what each test asserts is counted by
# the server and the page (parks, pauses, texts), not timed; the one clock, nginx's read timeout,
# is eight keepalive intervals. A second xdist worker beside it only makes it slower.
pytestmark = [pytest.mark.server, pytest.mark.slow]

# Greedy, a fixed length (the random weights would stop at random), so the chats' sizes are
# known. Short replies to long messages: the long prompts make the chats large, and every
# reply keeps a lead above NEAR_TIE (below) at each of its steps, so that batch-shape float
# noise cannot change it. llama.cpp rounds the context up to a multiple of 256.
TOKENS = 64
SAMPLING = ("--temp", "0", "--top-k", "1", "-n", str(TOKENS), "--ignore-eos")
# Four chats of about 230 (the message, and the tool definitions the UI sends) + 64 tokens in
# 4 slots sharing 512 cells: two prompts fit, two replies do not. The park lengths are counted
# in the model's steps, not in seconds: a chat whose prompt does not fit waits for a whole reply
# of another (64 steps), and two running chats overflow the pool when each holds 256 cells,
# about 26 tokens in, so the one parked then waits for the other's last 38 or so.
FOUR_POOL = ("--parallel", "4", "--ctx-size", "512", "--preempt-ram", "8192")
# The sidecar's keepalives well within nginx's read timeout, itself shorter than the parks
# (0.4 to 12 s at load 13-19; the longest, a whole reply, takes seconds on an idle machine too).
# nginx moves a read deadline only when the new one is 300 ms or more past the old, so a
# timeout of T can fire T - 0.3 s after the last byte: at 0.5 s it cut streams whose
# keepalives came 0.27 s apart under load, and answered 504 to requests the loaded sidecar had
# not answered within that (the page then resumed or failed those chats).
KEEPALIVE_S = 0.125
NGINX_READ_TIMEOUT_S = 1.0
PAUSE = "[data-stream-paused]"
NOTE = "[data-stream-paused-note]"
DURATION = r"(\d+ ms|\d+\.\d s|\d+ min \d+ s)"
NOTE_TEXT = re.compile(rf"Paused {DURATION}, waiting for memory\.|"
                       rf"Paused \d+ times, waiting for memory \({DURATION} in all\)\.")
INPUT = "Type a message..."  # the chat form's placeholder

# Added to every page before the UI's own scripts run: records the pause notice as the DOM
# shows it, and tees every chat stream the UI reads (request body, bytes) into window.
RECORDER = """
(() => {
  const rec = { shown: 0, texts: [], now: false, reconnecting: false, streams: [], resumes: [] };
  window.__sidecarTest = rec;
  const look = () => {
    const el = document.querySelector('[data-stream-paused]');
    if (el && !rec.now) rec.shown += 1;
    if (el) {
      const t = el.textContent.replace(/\\s+/g, ' ').trim();
      if (rec.texts[rec.texts.length - 1] !== t) rec.texts.push(t);
    }
    rec.now = !!el;
    for (const s of document.querySelectorAll('[role=status]')) {
      if (/Reconnecting/.test(s.textContent)) rec.reconnecting = true;
    }
  };
  new MutationObserver(look)
    .observe(document, { subtree: true, childList: true, characterData: true });
  const fetch0 = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const resp = await fetch0(input, init);
    const url = typeof input === 'string' ? input : (input.url || String(input));
    // the page's way back into a stream whose connection was lost: the server's replay
    if (url.includes('/v1/stream?')) rec.resumes.push(url);
    if (url.includes('/v1/chat/completions') && resp.body) {
      const body = init && typeof init.body === 'string' ? init.body : null;
      const s = { body, text: '', done: false, status: resp.status };
      rec.streams.push(s);
      const reader = resp.clone().body.getReader();
      const dec = new TextDecoder();
      (async () => {
        for (;;) {
          const { done, value } = await reader.read();
          if (done) break;
          s.text += dec.decode(value, { stream: true });
        }
        s.done = true;
      })().catch((e) => { s.error = String(e); s.done = true; });
    }
    return resp;
  };
})();
"""

READ_STORED_REPLIES = """
() => new Promise((resolve, reject) => {
  const open = indexedDB.open('LlamaUi');
  open.onerror = () => reject(open.error);
  open.onsuccess = () => {
    const q = open.result.transaction('messages').objectStore('messages').getAll();
    q.onerror = () => reject(q.error);
    q.onsuccess = () => resolve(q.result.filter((m) => m.role === 'assistant')
      .map((m) => ({ convId: m.convId, content: m.content,
                     pauses: (m.timings && m.timings.paused) ? m.timings.paused.count : 0 })));
  };
})
"""


def up_stack(tmp: Path, binary: Path, model: Path, pool: tuple[str, ...],
             env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> UpProcess:
    keepalives = {"LLAMA_SIDECAR_PARK_KEEPALIVE": f"{KEEPALIVE_S:g}",
                  "LLAMA_SIDECAR_IDLE_KEEPALIVE": f"{KEEPALIVE_S:g}"}  # fmt: skip
    # llama-server reads its test knobs only with --preempt-test-knobs
    has_knobs = any(k.startswith(TEST_KNOB_PREFIX) for k in env or {})
    knobs = ["--preempt-test-knobs"] if has_knobs else []
    up = UpProcess(["--server-bin", str(binary), "--model", str(model), *pool, *extra,
                    "--", *SAMPLING, "-t", "1", *knobs],
                   tmp, env={**keepalives, **(env or {})})  # fmt: skip
    up.log_dir.mkdir(parents=True, exist_ok=True)
    up.start(timeout=240)
    require_page(up)
    return up


def require_page(up: UpProcess) -> None:
    """The stack serves the chat page; without node/npm the build has none: skip, saying so."""
    if has_page(up.server_url):
        return
    up.kill()
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm are not installed, so llama-server was built without its web UI "
                    "(apt-get install nodejs npm, then build again)")
    pytest.fail(f"{up.args[1]} serves no chat page at / (a build without its web UI?)")


@pytest.fixture(scope="module")
def reference_server(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
                     slow_model: Path) -> Iterator[LlamaServer]:
    """A llama-server without parks or pressure: what each chat's text must be."""
    tmp = tmp_path_factory.mktemp("reference")
    srv = LlamaServer(llama_server_bin, slow_model, ["--parallel", "1", "--ctx-size", "1024",
                                                  *SAMPLING, "-t", "1"],
                      log_path=tmp / "llama-server.log")  # fmt: skip
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


# The smallest lead of the greedy token over the next, in logprob, at every step of a reply
# alone: batch-shape float noise (other chats in the batch, parked or not) moves logits by up to
# about 0.01 and flipped a prompt whose lead was 0.046 in about one run in eight, with or without
# parks. Such a prompt cannot tell a wrong restore from noise.
NEAR_TIE = 0.2


# The reference reply of each request body, once per reference server: a body that several
# tests send (the same message in a fresh chat) is generated once.
_REFERENCES: dict[tuple[str, str], str] = {}


def reference_text(ref: LlamaServer, request_body: str) -> str:
    key = (ref.url, request_body)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_text(ref, request_body)
    return _REFERENCES[key]


def _reference_text(ref: LlamaServer, request_body: str) -> str:
    body = json.loads(request_body)
    body["stream"] = False
    body.pop("stream_options", None)
    body.update(logprobs=True, top_logprobs=2)
    r = httpx.post(ref.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    leads = [t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"]
             for t in choice["logprobs"]["content"]]  # fmt: skip
    assert min(leads) > NEAR_TIE, ("a near-tie in the reference reply", min(leads),
                                   leads.index(min(leads)), body["messages"][-1]["content"][:60])
    content: str = choice["message"]["content"]
    return content


def pauses_in(stream_text: str) -> int:
    """The pauses of a stream by the chat service's rule: a park, its keepalive or a wait in
    the queue starts one, a resume or the next data ends it."""
    count, paused = 0, False
    for line in stream_text.splitlines():
        if line.startswith(":"):
            name = (line[1:].split() or [""])[0].lower()
            if name in ("preempted", "preempt-keepalive", "queued") and not paused:
                count, paused = count + 1, True
            elif name in ("resumed", "recomputed"):
                paused = False
        elif line.startswith("data:"):
            paused = False
    return count


@dataclass(eq=False)
class Chat:
    """One tab: its page, and what it recorded."""

    page: Any
    errors: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = self.page.evaluate("() => window.__sidecarTest")
        return rec

    def stream(self) -> dict[str, Any]:
        rec = self.record()
        streams = rec["streams"]
        assert len(streams) == 1, [s.get("body") for s in streams]
        stream: dict[str, Any] = streams[0]
        # A connection lost midway: the page resumes from the server's replay, this copy ends.
        assert "error" not in stream, (stream["error"], rec["resumes"], stream["text"][-300:])
        assert rec["resumes"] == [], rec["resumes"]
        return stream

    def parks(self) -> int:
        """The server's own count for this chat: the final `"preempt"` record."""
        parks = [int(json.loads(line[5:])["preempt"]["parks"])
                 for line in self.stream()["text"].splitlines()
                 if line.startswith("data:") and '"preempt"' in line]  # fmt: skip
        assert len(parks) == 1, self.stream()["text"][-2000:]
        return parks[0]

    def stored(self) -> dict[str, Any]:
        m = re.search(r"/chat/([^/?#]+)", self.page.url)
        assert m, self.page.url
        replies = [r for r in self.page.evaluate(READ_STORED_REPLIES) if r["convId"] == m.group(1)]
        assert len(replies) == 1, replies
        reply: dict[str, Any] = replies[0]
        return reply

    def stored_reply(self) -> str:
        content: str = self.stored()["content"]
        return content

    def note(self, want: int) -> int:
        """The pauses the reply's note counts (0: no note), once it says `want` or after 10 s:
        the page stores a finished reply, then shows it with its timings."""
        def read() -> int:
            notes = self.page.locator(NOTE)
            if notes.count() == 0:
                return 0
            assert notes.count() == 1
            assert NOTE_TEXT.fullmatch(notes.inner_text().strip()), notes.inner_text()
            return int(notes.get_attribute("data-pauses") or "0")
        deadline = time.monotonic() + 10
        while read() != want and time.monotonic() < deadline:
            self.page.wait_for_timeout(100)
        return read()


def open_chat(context: Any, url: str) -> Chat:
    page = context.new_page()
    chat = Chat(page)
    page.on("pageerror", lambda e: chat.errors.append(str(e)))
    page.goto(url + "/", wait_until="domcontentloaded")
    page.get_by_placeholder(INPUT).wait_for(timeout=60_000)
    return chat


def send(chat: Chat, text: str) -> None:
    box = chat.page.get_by_placeholder(INPUT)
    box.fill(text)
    box.press("Enter")


def all_tabs(chats: list[Chat], path: Path) -> None:
    """The tabs side by side in one picture (2 x 2 for four), as they are at this moment."""
    try:
        from PIL import Image
    except ImportError:  # pillow comes with the plot extra; without it, no picture
        return
    shots = [Image.open(io.BytesIO(chat.page.screenshot())) for chat in chats]
    w, h = shots[0].size
    cols = 2 if len(shots) > 1 else 1
    rows = (len(shots) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * w + (cols - 1) * 8, rows * h + (rows - 1) * 8), "#888888")
    for k, shot in enumerate(shots):
        sheet.paste(shot, ((k % cols) * (w + 8), (k // cols) * (h + 8)))
    sheet.save(path)


def drive(chats: list[Chat], artifacts: Path, name: str, timeout: float = 240.0) -> None:
    """Wait until every chat's stream is done; screenshot the first page seen paused."""
    shot = False
    seen: dict[int, float] = {}  # chat -> when its notice was first seen
    deadline = time.monotonic() + timeout
    pending = list(chats)
    while pending:
        assert time.monotonic() < deadline, "chats still streaming after the timeout"
        for i, chat in enumerate(chats):
            if shot or chat not in pending or chat.page.locator(PAUSE).count() == 0:
                continue
            # once the notice has faded in and counted a second or so
            if time.monotonic() - seen.setdefault(i, time.monotonic()) > 0.8:
                chat.page.screenshot(path=str(artifacts / f"{name}-paused.png"))
                if len(chats) > 1:
                    all_tabs(chats, artifacts / f"{name}-tabs.png")
                shot = True
        for chat in list(pending):
            streams = chat.record()["streams"]
            if streams and streams[0]["done"]:
                pending.remove(chat)
        chats[0].page.wait_for_timeout(50)
    # The UI stores the reply when the stream ends; wait until it has.
    for chat in chats:
        chat.page.locator(PAUSE).wait_for(state="detached", timeout=30_000)
        chat.page.wait_for_function("() => !document.querySelector('[data-stream-paused]')")
        chat.page.locator(".chat-message-assistant").last.wait_for(timeout=30_000)
    chats[-1].page.wait_for_timeout(300)  # the picture after the last fade
    chats[-1].page.screenshot(path=str(artifacts / f"{name}-done.png"))


def no_error_shown(chat: Chat) -> None:
    assert chat.errors == [], chat.errors
    assert chat.page.locator("[role=alertdialog]").count() == 0
    assert chat.page.locator("[data-sonner-toast][data-type=error]").count() == 0
    assert chat.stream()["status"] == 200
    assert "error" not in chat.stream(), chat.stream()
    assert not chat.record()["reconnecting"]


# About 220 characters each (the generated model's tokens are mostly characters). Each reply
# alone keeps a lead above NEAR_TIE at every step (the smallest: 0.57, 2.95, 5.42, 1.94).
STORY = (" The keeper wrote down every ship that passed the rocks, its flag, its cargo and the"
         " hour, in a book that nobody read, until the winter the lamp went out. The ships went"
         " on by in the dark.")  # fmt: skip
PROMPTS = [f"Tell me a story about a lighthouse.{STORY}", f"Write a poem about the sea.{STORY}",
           f"Explain how tides work.{STORY}", f"Name five famous lighthouses.{STORY}"]  # fmt: skip


def metric(up: UpProcess, name: str) -> float:
    text = httpx.get(up.server_url + "/metrics", timeout=30).text
    m = re.search(rf"^llamacpp:{name} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def four_chats(browser: Any, url: str, up: UpProcess, ref: LlamaServer, artifacts: Path,
               name: str) -> None:
    context = browser.new_context(viewport={"width": 1000, "height": 760})
    context.add_init_script(RECORDER)
    try:
        chats = [open_chat(context, url) for _ in PROMPTS]
        parks_before = metric(up, "n_preempt_total")
        for chat, prompt in zip(chats, PROMPTS, strict=True):
            send(chat, prompt)
        drive(chats, artifacts, name)
        parks = [chat.parks() for chat in chats]
        for chat in chats:
            no_error_shown(chat)
            assert chat.stored_reply() == reference_text(ref, chat.stream()["body"])
        # A request that waited for room before it started (`: queued`, where the server sends
        # it) is paused for its client as much as a parked one.
        queued = [": queued" in chat.stream()["text"] for chat in chats]
        pauses = [pauses_in(chat.stream()["text"]) for chat in chats]
        paused = [p > 0 or q for p, q in zip(parks, queued, strict=True)]
        assert paused == [n > 0 for n in pauses], (parks, queued, pauses)
        # Every parked (or queued) chat keeps a note that counts its pauses, however short, in
        # the page and with the stored reply; no other chat has one.
        assert [chat.note(n) for chat, n in zip(chats, pauses, strict=True)] == pauses
        assert [chat.stored()["pauses"] for chat in chats] == pauses
        # The live notice showed on paused chats only (a park of a few milliseconds can be over
        # before the page draws it).
        shown = [chat.record()["shown"] for chat in chats]
        print(f"four chats ({name}): parks {parks}, queued {queued}, pauses {pauses}, "
              f"notice shown {shown}")  # fmt: skip
        assert all(s <= n for s, n in zip(shown, pauses, strict=True)), (shown, pauses)
        assert sum(p > 0 for p in parks) >= 1, "the pool never overflowed: nothing was parked"
        assert metric(up, "n_preempt_total") - parks_before == sum(parks)
        for chat in chats:
            for text in chat.record()["texts"]:
                assert re.fullmatch(r"Paused, waiting for memory \((\d+ s|\d+ min \d+ s) so far\)\."
                                    r" The reply will continue where it left off\.", text), text
    finally:
        context.close()


# ---- the tests ----------------------------------------------------------------------------


# A forced park (LLAMA_SERVER_PREEMPT_EVERY) is restored in the same step of the server: its
# `: preempted` and `: resumed` reach the page in one read, a pause of 0 ms that the live
# notice never shows (the reply's note counts it). So the one chat also meets pressure: a
# larger request (a long prompt, through the API) holds most of a pool that cannot take both,
# and the page's chat, the smaller one, waits parked until it is done.
EVERY = 10
# About 485 tokens (the generated model's vocabulary is mostly single characters): with its
# 64 it holds more than the page's chat (about 230 + 64) at every step, so the page's chat is
# the one parked; both prompts fit in 768 cells (about 715), both replies do not (about 845).
HOG_PROMPT = "The keeper of the lighthouse wrote down every ship that passed. " * 8


@pytest.fixture(scope="module")
def forced(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
           slow_model: Path) -> Iterator[UpProcess]:
    up = up_stack(tmp_path_factory.mktemp("forced"), llama_server_bin, slow_model,
                  ("--parallel", "2", "--ctx-size", "768", "--preempt-ram", "8192"),
                  env={"LLAMA_SERVER_PREEMPT_EVERY": str(EVERY)})
    try:
        yield up
    finally:
        up.kill()


def test_one_chat_with_forced_parks_shows_the_pause_and_keeps_the_text(
    browser: Any, forced: UpProcess, reference_server: LlamaServer, artifacts: Path
) -> None:
    banner = forced.text()
    assert f"  open {forced.url}/ in a browser" in banner, banner
    context = browser.new_context(viewport={"width": 1000, "height": 760})
    context.add_init_script(RECORDER)
    hog: list[StreamLog] = []
    try:
        chat = open_chat(context, forced.url)
        body = {"messages": [{"role": "user", "content": HOG_PROMPT}], "stream": True}
        thread = threading.Thread(target=lambda: hog.append(
            stream_sse(forced.url + "/v1/chat/completions", body, timeout=300)))
        thread.start()
        wait_until(lambda: metric(forced, "requests_processing") >= 1, 60, "the larger chat")
        send(chat, PROMPTS[0])
        drive([chat], artifacts, "forced")
        thread.join(300)
        assert hog, "the larger chat did not finish"
        assert hog[0].status == 200
        assert hog[0].done
        no_error_shown(chat)
        parks = chat.parks()
        assert parks >= TOKENS // EVERY - 1, parks  # the forced ones, at least
        assert chat.stream()["text"].count(": preempted") == parks
        rec = chat.record()
        assert rec["shown"] >= 1, (rec, [ln for ln in forced.server_log.read_text(
            errors="replace").splitlines() if "preempt" in ln or "resumed" in ln][-30:])
        assert rec["shown"] <= parks
        assert not rec["now"]  # and gone after
        assert chat.page.locator(PAUSE).count() == 0
        # and the reply keeps the note: every pause counted, the forced ones of 0 ms included
        pauses = pauses_in(chat.stream()["text"])
        assert pauses >= parks
        assert chat.note(pauses) == pauses
        assert chat.stored()["pauses"] == pauses
        assert chat.stored_reply() == reference_text(reference_server, chat.stream()["body"])
    finally:
        context.close()


@pytest.fixture(scope="module")
def pressure(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
             slow_model: Path) -> Iterator[UpProcess]:
    # Four prompts at once take longer than nginx's short read timeout before the first
    # token: the sidecar opens each stream early (its keepalives then run from the start),
    # as docs/operations.md advises for read timeouts that short.
    up = up_stack(tmp_path_factory.mktemp("four"), llama_server_bin, slow_model, FOUR_POOL,
                  env={"LLAMA_SIDECAR_EARLY_OPEN_AFTER": f"{KEEPALIVE_S:g}"})
    try:
        yield up
    finally:
        up.kill()


def test_four_chats_on_a_pool_for_two(browser: Any, pressure: UpProcess,
                                      reference_server: LlamaServer, artifacts: Path) -> None:
    four_chats(browser, pressure.url, pressure, reference_server, artifacts, "four")


@pytest.mark.nginx
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)")
def test_four_chats_through_nginx_with_a_read_timeout_shorter_than_the_parks(
    browser: Any, pressure: UpProcess, reference_server: LlamaServer, artifacts: Path,
    tmp_path: Path,
) -> None:
    nginx: Nginx = start_nginx(tmp_path / "nginx", pressure.port,
                               read_timeout=f"{round(NGINX_READ_TIMEOUT_S * 1e3)}ms")
    try:
        four_chats(browser, nginx.url, pressure, reference_server, artifacts, "nginx")
        parks = [float(x) for x in re.findall(r"resumed after ([0-9.]+) s",
                                               pressure.server_log.read_text(errors="replace"))]
        print(f"parks (s): {parks}")
        assert max(parks) > NGINX_READ_TIMEOUT_S, parks  # a park outlasted nginx's timeout
    finally:
        nginx.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
          tiny_model: Path) -> Iterator[UpProcess]:
    up = up_stack(tmp_path_factory.mktemp("keyed"), llama_server_bin, tiny_model,
                  ("--parallel", "2", "--ctx-size", "1024"), extra=("--api-key", "s3cret-key"))
    try:
        yield up
    finally:
        up.kill()


def test_api_key_through_the_pages_own_key_prompt(browser: Any, keyed: UpProcess,
                                                  artifacts: Path) -> None:
    assert httpx.get(keyed.url + "/props", timeout=30).status_code == 401
    context = browser.new_context(viewport={"width": 1000, "height": 760})
    context.add_init_script(RECORDER)
    try:
        page = context.new_page()
        page.goto(keyed.url + "/", wait_until="domcontentloaded")
        # The page loaded without the key; the API answered 401, and the UI offers its prompt.
        page.get_by_role("button", name="Enter API Key").click(timeout=60_000)
        key_box = page.locator("#api-key-input")
        key_box.fill("not-the-key")
        page.get_by_role("button", name="Save & Retry").click()
        page.get_by_text("Invalid API key").wait_for(timeout=30_000)
        assert page.get_by_placeholder(INPUT).count() == 0  # a wrong key gets no chat
        page.screenshot(path=str(artifacts / "api-key-prompt.png"))
        if key_box.count() == 0:
            page.get_by_role("button", name="Enter API Key").click(timeout=30_000)
        key_box.fill("s3cret-key")
        page.get_by_role("button", name="Save & Retry").click()
        chat = Chat(page)
        page.get_by_placeholder(INPUT).wait_for(timeout=60_000)
        send(chat, "Say hello.")
        drive([chat], artifacts, "keyed")
        no_error_shown(chat)
        assert chat.stored_reply()
    finally:
        context.close()
