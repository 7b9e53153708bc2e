"""apply_priority: the splice's work per step of the event loop, its memory, its refusals."""

from __future__ import annotations

import json
import tracemalloc

import anyio
import anyio.lowlevel
import h11
import pytest

from sidecar.core.errors import BadRequest, ClientError, Forbidden, UnsupportedMediaType
from sidecar.core.priority import PriorityRules
from sidecar.proxy.request import SPLICE_STEP_BYTES, RequestPlan, apply_priority
from sidecar.proxy.upstream import RequestBody

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
RULES = PriorityRules(default=5)


class WatchedBody(RequestBody):
    """A RequestBody that notes whether it was closed."""

    __slots__ = ("closed",)

    def __init__(self, in_memory: int) -> None:
        super().__init__(in_memory)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


def request(target: str = "/completion", *headers: tuple[str, str]) -> h11.Request:
    return h11.Request(method="POST", target=target,
                       headers=[("Host", "x"), ("Content-Length", "1"), *headers])  # fmt: skip


def plan() -> RequestPlan:
    return RequestPlan(chunked=False, has_body=True, key_given=None, wants_stream=False)


def attack_body(size: int, in_memory: int = 64 * 1024) -> WatchedBody:
    """``{"a":[{},{},...]}`` of about ``size`` bytes: the many-small-values body."""
    body = WatchedBody(in_memory)
    body.append(b'{"a":[')
    for _ in range(size // MiB):
        body.append(b"{}," * (MiB // 3))
    body.append(b"{}]}")
    return body


async def test_a_large_body_is_spliced_in_steps_with_the_loop_served_between() -> None:
    """Every other task runs between two steps: a ticker task advances at least once per
    SPLICE_STEP_BYTES of the body (twice over: the scan and the copy)."""
    body = attack_body(8 * MiB)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        before = ticks
        out, outcome, priority = await apply_priority(body, request(), plan(), RULES, 64 * 1024)
        during = ticks - before
        done = True
    assert (outcome, priority) == ("set", 5)
    assert out is not None
    assert during >= 2 * (body.size // SPLICE_STEP_BYTES) - 2, during
    assert body.closed
    out.close()


async def test_a_rewrite_takes_memory_of_its_buffer_not_of_its_values() -> None:
    """Rewriting a 4 MiB body of a million empty objects allocates a few MiB at most (a parse
    built the million objects: hundreds of MiB, for a 30 MiB body gigabytes)."""
    body = attack_body(4 * MiB)
    tracemalloc.start()
    try:
        out, outcome, _ = await apply_priority(body, request(), plan(), RULES, 1 * MiB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome == "set"
    assert out is not None
    assert peak < 4 * MiB, f"peak {peak / MiB:.1f} MiB"
    tail = b"".join(out.pieces())[-40:]
    out.close()
    assert tail.endswith(b'{},{}],"priority":5}')


@pytest.mark.parametrize(
    ("target", "headers", "data", "error"),
    [
        ("/completion", (), b'{"prompt":"x"}\x00', BadRequest),
        ("/completion", (), b"[1]", BadRequest),
        ("/completion%73", (), b'{"prompt":"x"}', BadRequest),
        ("/predict", (), b'{"instances":[]}', Forbidden),
        ("/completion", (("Content-Type", "multipart/form-data; boundary=b"),), b"{}",
         UnsupportedMediaType),
        ("/completion", (("Content-Encoding", "gzip"),), b"{}", UnsupportedMediaType),
    ],
)  # fmt: skip
async def test_a_refused_body_is_closed_at_once(
    target: str, headers: tuple[tuple[str, str], ...], data: bytes, error: type[ClientError]
) -> None:
    body = WatchedBody(0)  # on disk: a refusal must not leave its file open
    body.append(data)
    with pytest.raises(error):
        await apply_priority(body, request(target, *headers), plan(), RULES, 1024)
    assert body.closed


async def test_what_llama_server_refuses_is_spliced_not_decoded() -> None:
    """A lone surrogate escape or CESU-8 bytes are llama-server's to refuse (400): the splice
    decodes nothing, so nothing here can fail on them."""
    for data in (b'{"prompt":"\\ud800"}', b'{"prompt":"\xed\xa0\x80"}'):
        body = WatchedBody(1024)
        body.append(data)
        out, outcome, _ = await apply_priority(body, request(), plan(), RULES, 1024)
        assert outcome == "set"
        assert out is not None
        assert b"".join(out.pieces()) == data[:-1] + b',"priority":5}'
        out.close()


async def test_without_a_rule_or_off_the_generating_routes_nothing_changes() -> None:
    for rules, target in ((PriorityRules(), "/completion"), (RULES, "/tokenize")):
        body = WatchedBody(1024)
        body.append(b'{"content":"hi"} \x00 not json')
        out, outcome, priority = await apply_priority(body, request(target), plan(), rules, 1024)
        assert (out, outcome, priority) == (body, None, None)
        assert not body.closed
        assert json.loads(b"".join(body.pieces()).split(b" ")[0]) == {"content": "hi"}
        body.close()
