"""apply_priority: where a large body is read back and parsed."""

from __future__ import annotations

import json
import threading

import h11
import pytest

from sidecar.priority import PriorityRules
from sidecar.request import PRIORITY_INLINE_PARSE, RequestPlan, apply_priority
from sidecar.upstream import RequestBody

pytestmark = pytest.mark.anyio


class WatchedBody(RequestBody):
    """A RequestBody that notes the threads its bytes are read back on."""

    __slots__ = ("readers",)

    def __init__(self, in_memory: int) -> None:
        super().__init__(in_memory)
        self.readers: set[int] = set()

    def pieces(self):  # type: ignore[no-untyped-def]
        self.readers.add(threading.get_ident())
        yield from super().pieces()


def request() -> h11.Request:
    return h11.Request(method="POST", target="/completion",
                       headers=[("Host", "x"), ("Content-Length", "1")])


@pytest.mark.parametrize("size", [1000, 2 * PRIORITY_INLINE_PARSE])
async def test_a_large_body_is_read_back_and_parsed_off_the_event_loop(size: int) -> None:
    """A body past the inline limit (most of it in the temporary file when it is larger than
    --body-buffer) is read back on the worker thread, not on the loop every stream shares."""
    body = WatchedBody(in_memory=1024)  # spills to the file at once, like a large upload
    body.append(json.dumps({"prompt": "x" * size, "n_predict": 4}).encode())
    plan = RequestPlan(chunked=False, has_body=True, key_given=None, wants_stream=False)
    out, outcome, priority = await apply_priority(body, request(), plan,
                                                  PriorityRules(default=5), 1024)
    assert outcome == "set"
    assert priority == 5
    assert out is not None
    rewritten = b"".join(out.pieces())
    out.close()
    assert json.loads(rewritten)["priority"] == 5
    loop_thread = threading.get_ident()
    if size > PRIORITY_INLINE_PARSE:
        assert loop_thread not in body.readers, "a large body was read on the event loop"
    else:
        assert body.readers == {loop_thread}
