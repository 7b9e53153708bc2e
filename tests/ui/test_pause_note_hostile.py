"""The chat page's pause note against a lying upstream, in a real (headless) browser.

llama-server serves the page (the tiny model: nothing here is generated); the browser answers
the page's chat request itself (Playwright's request routing) with one stream of what a lying
or broken upstream can send: thousands of `: preempted` / `: resumed` pairs, resumes without a
park, malformed notices, absurd numbers after them, a `paused` claim in the timings, and a
park and text after `data: [DONE]`. The page must stay up, store and show the reply's text
without any of it, and keep a note that counts the pauses by its rule (a park starts one unless
one runs, a resume or data ends it, nothing after the end counts), not what the server claims.
The chat service's own tests of the same are the UI patch's Vitest file
stream-notices-hostile.test.ts (tests/ui/test_ui_unit.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.cli.up import has_page
from tests.conftest import StartServer
from tests.ui.test_chat_page import NOTE, NOTE_TEXT, RECORDER, Chat, open_chat, send

pytestmark = [pytest.mark.server, pytest.mark.slow]

PAIRS = 5_000


def data(content: str, **extra: Any) -> str:
    chunk = {"choices": [{"delta": {"content": content}, "index": 0}], "id": "c1",
             "object": "chat.completion.chunk", **extra}  # fmt: skip
    return f"data: {json.dumps(chunk)}\n\n"


LYING_STREAM = "".join([
    ": resumed\n\n",  # a resume without a park
    data("Hello"),
    ": preempted\n\n: resumed\n\n" * PAIRS,  # in one read
    ": preempted 1e309\n\n: preempt-keepalive -1\n\n",  # one more, with absurd numbers
    ": resumed:preempted\n\n:preempted\0\n\n: " + "x" * 100_000 + "\n\n",  # not notice names
    ": resumed NaN\n\n: resumed\n\n",
    data(", world", timings={"paused": {"count": 1e9, "ms": 1e300}, "predicted_n": 2}),
    "data: [DONE]\n\n",
    ": preempted\n\n",  # after the end: neither counted nor shown
    data(" and more"),
])  # fmt: skip


def test_a_lying_upstream_leaves_the_text_and_a_sane_note(
    browser: Any, start_server: StartServer
) -> None:
    # the helper starts llama-server --no-webui; the later flag wins
    srv = start_server(args=["--parallel", "1", "--ctx-size", "512", "--webui"])
    if not has_page(srv.url):
        pytest.fail(f"{srv.url} serves no chat page at / (a build without its web UI?)")
    context = browser.new_context(viewport={"width": 1000, "height": 760})
    context.add_init_script(RECORDER)
    try:
        context.route(
            "**/v1/chat/completions",
            lambda route: route.fulfill(
                status=200, headers={"Content-Type": "text/event-stream"}, body=LYING_STREAM
            ),
        )
        chat: Chat = open_chat(context, srv.url)
        send(chat, "Say hello.")
        chat.page.locator(".chat-message-assistant").last.wait_for(timeout=30_000)
        pauses = PAIRS + 1
        assert chat.note(pauses) == pauses
        assert NOTE_TEXT.fullmatch(chat.page.locator(NOTE).inner_text().strip())
        assert f"Paused {pauses} times" in chat.page.locator(NOTE).inner_text()
        assert chat.stored()["pauses"] == pauses
        assert chat.stored_reply() == "Hello, world"
        assert chat.page.locator(".chat-message-assistant").last.inner_text().count("world") == 1
        assert "and more" not in chat.page.locator(".chat-message-assistant").last.inner_text()
        assert chat.errors == [], chat.errors
        assert chat.page.locator("[data-stream-paused]").count() == 0
    finally:
        context.close()
