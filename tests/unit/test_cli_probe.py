"""`probe`'s pure parts: line splitting, request bodies, the per-stream summary, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.ops.probe import (
    ProbeOptions,
    StreamRecord,
    build_body,
    endpoint_url,
    plot,
    split_lines,
    summarize,
    table,
    to_json,
)


def chat(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})


@pytest.mark.parametrize(
    ("buf", "lines", "rest"),
    [
        (b"a\nb\n", [b"a", b"b"], b""),
        (b"a\r\nb\rc", [b"a", b"b"], b"c"),
        (b"a\r", [], b"a\r"),  # may be the first half of \r\n
        (b"\n\n", [b"", b""], b""),
    ],
)
def test_split_lines(buf: bytes, lines: list[bytes], rest: bytes) -> None:
    assert split_lines(buf) == (lines, rest)


def test_split_lines_any_chunking_gives_the_same_lines() -> None:
    stream = b": preempted\r\n\r\ndata: x\n\n: resumed\r\rdata: y\r\n"
    whole, _ = split_lines(stream)
    for step in (1, 2, 3, 5):
        got: list[bytes] = []
        buf = b""
        for i in range(0, len(stream), step):
            part, buf = split_lines(buf + stream[i : i + step])
            got += part
        assert got == whole


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://h:1", "http://h:1/v1/chat/completions"),
        ("http://h:1/", "http://h:1/v1/chat/completions"),
        ("h:1", "http://h:1/v1/chat/completions"),
        ("http://h:1/completion", "http://h:1/completion"),
    ],
)
def test_endpoint_url(url: str, expected: str) -> None:
    assert endpoint_url(url) == expected


def test_build_body_per_dialect() -> None:
    o = ProbeOptions(url="x", max_tokens=7, prompt="hi", extra={"temperature": 0})
    chat_body = build_body("http://h/v1/chat/completions", o)
    assert chat_body["messages"] == [{"role": "user", "content": "hi"}]
    assert chat_body["max_tokens"] == 7
    assert chat_body["stream"]
    assert chat_body["ignore_eos"]
    assert chat_body["temperature"] == 0
    assert build_body("http://h/v1/completions", o)["max_tokens"] == 7
    native = build_body("http://h/completion", o)
    assert native["n_predict"] == 7
    assert native["prompt"] == "hi"
    no_eos = ProbeOptions("x", ignore_eos=False)
    assert "ignore_eos" not in build_body("http://h/completion", no_eos)


def parked_stream() -> StreamRecord:
    lines = [(0.10, chat("a")), (0.20, chat("b")), (0.30, ": preempted"),
             (1.30, ": preempt-keepalive"), (2.30, ": preempt-keepalive"), (2.80, ": resumed"),
             (2.90, chat("c")), (3.00, ":"), (3.10, chat("d")), (3.2, ": keepalive"),
             (3.20, "data: [DONE]")]  # fmt: skip
    return StreamRecord(0, t_start=0.0, t_headers=0.05, t_end=3.25, status=200, lines=lines)


def test_summarize_counts_notices_and_silence() -> None:
    s = summarize(parked_stream())
    assert s.outcome == "done"
    assert (s.parks, s.resumes, s.recomputes) == (1, 1, 0)
    assert s.keepalives == 3
    assert s.pings == 1
    assert s.tokens == 4
    assert s.park_spans == [(0.30, 2.80)]
    assert s.parked_s == pytest.approx(2.5)
    assert s.longest_silence_s == pytest.approx(1.0)
    assert s.ttft_s == pytest.approx(0.10)
    assert s.tokens_per_s == pytest.approx(3 / 3.0)


def test_summarize_indexed_notices_recompute_and_unpaired_park() -> None:
    lines = [(0.1, ": preempted 0"), (0.2, ": preempted 1"), (0.5, ": resumed 0"),
             (0.5, ": recomputed 0"), (0.6, chat("x"))]  # fmt: skip
    s = summarize(StreamRecord(1, 0.0, 0.01, 1.0, 200, lines))
    assert (s.parks, s.resumes, s.recomputes) == (2, 1, 1)
    assert s.park_spans == [(0.1, 0.5), (0.2, 1.0)]  # prompt 1 parked until the end
    assert s.outcome == "truncated"


def test_summarize_errors() -> None:
    s = summarize(StreamRecord(0, 0.0, 0.01, 0.02, 503, [(0.01, '{"error": "loading"}')]))
    assert s.outcome == "error"
    assert "503" in (s.error or "")
    s = summarize(StreamRecord(0, 0.0, 0.01, 0.5, 200, [(0.1, chat("a"))], error="ReadError"))
    assert s.outcome == "error"
    ev = 'data: {"error": {"code": 500, "message": "context full"}}'
    s = summarize(StreamRecord(0, 0.0, 0.01, 0.5, 200, [(0.1, ev)]))
    assert s.outcome == "error"
    assert s.error == "context full"


def test_token_count_comes_from_the_server_when_it_says() -> None:
    final = 'data: {"choices": [{"delta": {}}], "timings": {"predicted_n": 5}}'
    lines = [(0.1, chat("a")), (0.2, chat("b")), (0.3, final), (0.3, "data: [DONE]")]
    s = summarize(StreamRecord(0, 0.0, 0.05, 0.35, 200, lines))
    assert s.tokens == 5
    assert s.outcome == "done"


def test_native_completion_stream() -> None:
    lines = [(0.1, 'data: {"content": "a", "stop": false}'),
             (0.2, 'data: {"content": "b", "stop": false}'),
             (0.3, 'data: {"content": "", "stop": true, "timings": {}}')]  # fmt: skip
    s = summarize(StreamRecord(0, 0.0, 0.05, 0.35, 200, lines))
    assert s.outcome == "done"
    assert s.tokens == 2


def test_table_and_json() -> None:
    recs = [parked_stream(), parked_stream()]
    recs[1].index = 1
    sums = [summarize(r) for r in recs]
    text = table(sums)
    assert text.splitlines()[0].split()[:3] == ["stream", "status", "outcome"]
    assert "2/2 done" in text.splitlines()[-1]
    doc = to_json(ProbeOptions(url="http://h:1"), recs, sums)
    json.dumps(doc)
    assert doc["totals"]["parks"] == 2
    assert doc["totals"]["keepalives"] == 6
    assert doc["streams"][0]["lines"][2] == {"t": 0.3, "text": ": preempted"}


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is the [plot] extra")
    recs = [parked_stream(), StreamRecord(1, 0.0, 0.01, 0.5, 200, [(0.1, chat("a"))])]
    out = tmp_path / "probe.png"
    plot([summarize(r) for r in recs], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
