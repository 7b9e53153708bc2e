"""KV preemption must always make progress and keep every promise it makes.

Each test reproduces one way the series broke that, against the real binary: a request that
hung while the server spun (the last resort parking and restoring without end, or picking a
victim it could not park), a high-priority request parked for a low-priority family, a slot
recomputed after a context shift (its answer changed), requests behind the parked line that came
back out of order or waited in silence, a flag that changed what "off" means, a restored slot
cache dropped after a 200, and a /metrics scrape that changed while the server slept.

A hang must end as a test failure, never as a hung suite: `bounded()` runs the request on a
thread and fails as soon as the server's log shows the loop (a marker line repeated far beyond
what progress needs) or a generous limit passes. Sizes are chosen so that the state each test
needs comes from the token counts, not from the model's speed; where a second request must meet
the first at a given size, it is sent when /slots reports that size (the "slow" generated model,
as in test_preempt_defects.py). The first request reaches that size mostly with its prompt and
the last few cells generated: a prompt token costs a fraction of a generated one, and from the
second request's arrival on, the two are what they were with a short prompt and a long answer.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from sidecar.paths import cache_dir
from tests.conftest import StartServer
from tests.server.preempt_helpers import (
    BASE,
    CONTEXT_ERROR,
    LAST_RESORT_LINE,
    PARK,
    PARK_LINE,
    ROTATE_NOW,
    RawStream,
    complete,
    complete_many,
    completion_body,
    count_lines,
    metrics,
    slots,
    token_prompt,
    wait_for,
    wait_settled,
)
from tests.server.test_preempt_defects import (
    Background,
    assert_complete,
    body,
    grown_alone,
    park_a_pair,
    streamed,
)
from tests.support.llama import LlamaServer
from tests.support.sse_client import stream_sse
from tests.support.tinymm import MmprojSpec, image_prompt, png, write_mmproj
from tests.support.tinymodel import SPECS, cached, ensure_model

pytestmark = [pytest.mark.server]

PLANNER_OFF = {"LLAMA_SERVER_PREEMPT_PLANNER": "off"}
FAIL_SAVE = {"LLAMA_SERVER_PREEMPT_FAIL_SAVE": "1"}
FAIL_POOL = {"LLAMA_SERVER_PREEMPT_FAIL_POOL": "1"}
NOTHING_PARKED_LINE = "last resort found nothing to park"

T = TypeVar("T")


def bounded(srv: LlamaServer, fn: Callable[[], T], *, limit: float = 180.0,
            loop_marker: str = LAST_RESORT_LINE, loop_max: int = 200) -> T:
    """fn() on a thread; fail when the server's log holds `loop_marker` more than `loop_max`
    times (the server spins: on the series before the fixes, thousands of such lines a second)
    or when `limit` seconds pass without an answer."""
    t0 = time.monotonic()
    run = Background(fn)
    while run.thread.is_alive():
        run.thread.join(0.5)
        n = count_lines(srv.log_text(), loop_marker)
        if n > loop_max:
            pytest.fail(f"the server spins: {n} lines with {loop_marker!r} after "
                        f"{time.monotonic() - t0:.1f} s and no answer yet")
        if time.monotonic() - t0 > limit:
            pytest.fail(f"no answer after {limit:.0f} s; log tail:\n{srv.log_tail(20)}")
    return run.result(0)


def slot_lines(log: str, marker: str) -> list[tuple[int, int]]:
    """(slot id, task id) of every log line with `marker` (SLT_* lines: "id  N | task T | ")."""
    res: list[tuple[int, int]] = []
    for line in log.splitlines():
        if marker not in line or " | task " not in line:
            continue
        head = line.split(" | ")
        slot_id = int(head[0].rsplit("id", 1)[1])
        task_id = int(head[1].split()[1])
        res.append((slot_id, task_id))
    return res


# the last resort after a split batch with an n_cmpl family ------------------------------------


def test_a_split_batch_gives_the_children_the_whole_prompt(start_server: StartServer,
                                                           slow_model: Path) -> None:
    """Planner off, 64-token batches, a 256-cell pool. A generates; an n_cmpl 2 family with a
    126-token prompt arrives when A holds 130-160 cells, so the batch with its last 63 prompt
    tokens does not fit: the retry ladder halves it, the first half (A's token and 31 prompt
    tokens) is decoded, the rest is not, and the last resort parks A (the leader; the family is
    still in its prompt) and rewinds the parent to its cache. The children must not have been
    given the parent's cells after that first half: they then held part of the prompt, were
    rewound to prompt processing with it, re-filled the rest on their own while the pool was
    counted as if they shared it (the count fell short by their tails), and a slot restored on
    that count failed the next decode, was parked and restored again without end. Now only the
    parent is rewound, the children get the whole prompt when its last token is decoded, and
    every request completes with a bounded number of parks."""
    srv = start_server(model=slow_model,
                       args=[*BASE, *PARK, "-c", "256", "-np", "3", "-b", "64", "-ub", "64"],
                       env=PLANNER_OFF)
    # A's 122 prompt tokens plus 8 generated (208 cells at its end): the family's second batch
    # then meets 33-62 free cells
    a = grown_alone(srv, lambda: streamed(srv.url, body(token_prompt(122, 71), 86)), 122, 130)
    fam = bounded(srv, lambda: streamed(srv.url, body(token_prompt(126, 72), 24, n_cmpl=2)))
    assert_complete(fam, 2, [126], 24, multi_prompt=False, family=True)
    assert_complete(a.result(), 1, [122], 86, multi_prompt=False)
    log = srv.log_text()
    assert count_lines(log, LAST_RESORT_LINE) >= 1, "the family's batch fitted: no split batch"
    # "N tokens rewound to the cache boundary (K tokens), back to prompt processing"
    rewound = {task for _, task in slot_lines(log, "back to prompt processing")}
    assert len(rewound) == 1, f"tasks sent back to prompt processing: {sorted(rewound)}"
    m = wait_settled(srv.url)
    assert m["n_resume_total"] == m["n_preempt_total"] <= 4, m


# the last resort when no park succeeds -------------------------------------------------------


def llava_pair() -> tuple[Path, Path]:
    models = cache_dir() / "models"
    spec = MmprojSpec(n_embd_text=SPECS["tiny"].n_embd)
    return (ensure_model(models, "tiny"),
            cached(models / spec.file_name, lambda p: write_mmproj(p, spec)))


def picture(url: str, seed: int) -> dict[str, Any]:
    marker = httpx.get(f"{url}/props", timeout=10).json()["media_marker"]
    return image_prompt(["a picture: ", png(128, 48, seed), " what is it?"], marker)


@pytest.mark.parametrize("planner", ["on", "off"])
def test_a_park_that_fails_ends_in_the_context_error(start_server: StartServer,
                                                     planner: str) -> None:
    """Two image prompts that overflow a 256-cell pool together, and every host pool block fails
    to allocate (LLAMA_SERVER_PREEMPT_FAIL_POOL): an image slot can be parked only by swap, so
    no park succeeds. The last resort reported success anyway and the rebuilt batch failed the
    same way, forever (stock llama-server answers "Context size has been exceeded." at once).
    Now the failed victim is not parked again before something is freed, the last resort finds
    nothing, and the requests end: each completes or gets the context error."""
    text, mmproj = llava_pair()
    env = {**FAIL_POOL, **({} if planner == "on" else PLANNER_OFF)}
    srv = start_server(model=text, args=[*BASE, *PARK, "--mmproj", str(mmproj), "-c", "256",
                                         "-np", "2"], env=env)
    prompts: list[Any] = [picture(srv.url, 10), picture(srv.url, 11)]
    together = bounded(srv, lambda: complete_many(srv.url, prompts, 160, stream=False,
                                                  timeout=600),
                       loop_marker=NOTHING_PARKED_LINE, loop_max=20)
    for got in together:
        assert got.ok or got.error_message == CONTEXT_ERROR, got.error
    assert any(not got.ok for got in together), "both fit: the test needs an overflow"
    assert count_lines(srv.log_text(), NOTHING_PARKED_LINE) <= 2
    m = wait_settled(srv.url)
    assert m["requests_preempted"] == 0


def test_a_text_request_beside_image_slots_that_cannot_be_parked_completes(
    start_server: StartServer,
) -> None:
    """Two image prompts and a text prompt that fits the pool alone, host pool blocks failing:
    the image slots cannot be parked (swap only, no block), the text slot can (by recompute).
    With only the image slots' parks failing, the last resort found no victim and the stock
    error failed every slot of the batch, the text request too (it fits alone). The text slot is
    parked instead, though it leads, and everything completes. The three are prompts of one
    request, so they start in the same iteration however fast the model is: the images (37 + 60
    cells each) and the text (120 + 60) outgrow the 256-cell pool together about 18 tokens in,
    and the images fit together once the text slot is parked (an error of one prompt would end
    the response, the text's answer with it)."""
    text, mmproj = llava_pair()
    srv = start_server(model=text, args=[*BASE, *PARK, "--mmproj", str(mmproj), "-c", "256",
                                         "-np", "3"], env=FAIL_POOL)
    prompts: list[Any] = [picture(srv.url, 10), picture(srv.url, 11), token_prompt(120, 12)]
    together = bounded(srv, lambda: complete_many(srv.url, prompts, 60, timeout=600),
                       loop_marker=NOTHING_PARKED_LINE, loop_max=20)
    *pictures, words = together
    assert words.ok, words.error
    assert words.n_predicted == 60
    for got in pictures:
        assert got.ok or got.error_message == CONTEXT_ERROR, got.error
    assert words.preempt["parks"] >= 1, words.preempt
    m = wait_settled(srv.url)
    assert m["requests_preempted"] == 0


# an image chunk that does not fit ------------------------------------------------------------


def slow_mmproj() -> Path:
    """A projector for the slow model: image requests that generate slowly enough for a second
    request to meet them at a size read from /slots."""
    spec = MmprojSpec(n_embd_text=SPECS["slow"].n_embd)
    return cached(cache_dir() / "models" / spec.file_name, lambda p: write_mmproj(p, spec))


def test_an_image_chunk_that_does_not_fit_is_treated_as_a_prompt_that_does_not_fit(
    start_server: StartServer, slow_model: Path,
) -> None:
    """Planner off (the retry ladder and the last resort decide), a 256-cell pool. A generates
    alone (190 + 58 cells); a prompt that opens with four images in a row (64 cells) arrives when
    A holds about 200 cells: the images do not fit beside it. Image chunks are
    decoded on their own while the batch is built, outside the batch's retry ladder: the failed
    decode was answered 500 "failed to process mtmd chunk", nothing parked (the fuzz harness met
    it with mixed seed 4795). It now gets what a prompt batch that does not fit gets: the last
    resort parks a slot (the image request: A leads), and both requests complete."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "--mmproj", str(slow_mmproj()),
                                               "-c", "256", "-np", "2"], env=PLANNER_OFF)
    marker = httpx.get(f"{srv.url}/props", timeout=10).json()["media_marker"]
    prompt = image_prompt([*(png(128, 48, 20 + i) for i in range(4)), " what is it?"], marker)
    # A holds 198-248 cells when the images come: 64 cells do not fit beside it
    ta = grown_alone(srv, lambda: complete(srv.url, token_prompt(190, 21), 58, timeout=600),
                     190, 198)
    got = bounded(srv, lambda: complete(srv.url, prompt, 16, timeout=600), loop_marker=PARK_LINE)
    a = ta.result()
    log = srv.log_text()
    assert "failed to process mtmd chunk" not in log
    assert got.ok, got.error
    assert got.n_predicted == 16
    assert a.ok, a.error
    assert a.n_predicted == 58
    assert count_lines(log, "a media chunk found no room") >= 1, "the images fitted: no overflow"
    assert got.preempt["parks"] >= 1, got.preempt
    m = wait_settled(srv.url)
    assert m["n_resume_total"] == m["n_preempt_total"]
    assert m["requests_preempted"] == 0


# priority inversion with families ------------------------------------------------------------


def test_a_low_priority_family_is_parked_before_a_high_priority_request(
    start_server: StartServer, slow_model: Path,
) -> None:
    """A (priority 5, a 420-token prompt) generates alone; an n_cmpl 2 family of priority 0
    arrives when A holds 428 cells. Each fits the 512-cell pool alone, together they do not.
    The lowest rank is parked first, families included: the family is parked whole and A never
    is (it used to be, the leader being parked first whenever every other slot is in a
    family)."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "512", "-np", "3"])
    ta = grown_alone(srv, lambda: streamed(srv.url, body(token_prompt(420, 1), 68, priority=5)),
                     420, 428)
    fam = bounded(srv, lambda: streamed(srv.url, body(token_prompt(8, 2), 60, n_cmpl=2,
                                                       priority=0)))
    a = ta.result()
    fam_finals = assert_complete(fam, 2, [8], 60, multi_prompt=False, family=True)
    a_finals = assert_complete(a, 1, [420], 68, multi_prompt=False)
    assert b": preempted" not in a.body, "the priority-5 request was parked"
    assert a_finals[0]["preempt"]["parks"] == 0, a_finals[0]["preempt"]
    assert all(f["preempt"]["parks"] >= 1 for f in fam_finals.values()), fam_finals
    m = wait_settled(srv.url)
    assert m["n_resume_total"] == m["n_preempt_total"]
    assert m["n_preempt_priority_high_total"] == 0, m


def test_a_family_restored_member_by_member_is_parked_member_by_member(
    start_server: StartServer, slow_model: Path,
) -> None:
    """A (priority 5, a 340-token prompt) generates alone; an n_cmpl 3 family of priority 0 with
    a 100-token prompt arrives when A holds 348 cells. The family fits the 512-cell pool alone
    with its prompt shared (100 + 3 x 100 cells), not with it copied (3 x 200). It is parked
    whole while A grows, and comes back member by member when A ends, each member restored with
    its own copy of the prompt: the three outgrew the pool, no member could be parked (a family
    is parked only whole, and its members were the only slots), and all three got the context
    error (mixed fuzz seed 976). A restored member now holds its own cells and is parked on its
    own: the members take turns and every result completes."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "512", "-np", "4"])
    # A ends at 420 cells: the family's prompt fits beside it until then
    ta = grown_alone(srv, lambda: streamed(srv.url, body(token_prompt(340, 3), 80, priority=5)),
                     340, 348)
    fam = bounded(srv, lambda: streamed(srv.url, body(token_prompt(100, 4), 100, n_cmpl=3,
                                                       priority=0)), loop_marker=PARK_LINE)
    assert_complete(ta.result(), 1, [340], 80, multi_prompt=False)
    fam_finals = assert_complete(fam, 3, [100], 100, multi_prompt=False, family=True)
    # parked whole once, then at least one member again on its own
    parks = sorted(f["preempt"]["parks"] for f in fam_finals.values())
    assert parks[0] >= 1, parks
    assert parks[-1] >= 2, parks
    m = wait_settled(srv.url)
    assert m["n_resume_total"] == m["n_preempt_total"]
    assert m["requests_preempted"] == 0


def test_a_family_in_its_prompt_beside_a_leader_that_cannot_be_parked_waits(
    start_server: StartServer, slow_model: Path,
) -> None:
    """Host pool blocks failing: an image request (43 + 190 cells) generates and cannot be parked
    (swap only, no block); an n_cmpl 2 family with a 120-token prompt arrives when it holds about
    143 cells, and its prompt does not fit beside it. A family was a victim only once every
    member generated: the parent in its prompt (its child waiting for it, holding nothing) was
    no candidate, the leader's park failed, and the stock error failed every slot of the batch,
    the image request and the family with it (mixed fuzz seed 746, timing-dependent). The
    parent in its prompt is the whole family now: it is parked (by recompute), the image request
    completes, and so does the family after it, its child never parked."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "--mmproj", str(slow_mmproj()),
                                               "-c", "256", "-np", "3"], env=FAIL_POOL)
    marker = httpx.get(f"{srv.url}/props", timeout=10).json()["media_marker"]
    prompt = image_prompt([*(png(128, 48, 30 + i) for i in range(2)), " what is it?"], marker)
    # 143-233 cells when the family comes: its 120 prompt tokens do not fit beside them
    ti = grown_alone(srv, lambda: complete(srv.url, prompt, 190, timeout=600), 43, 143,
                     what="the image request")
    fam = bounded(srv, lambda: streamed(srv.url, body(token_prompt(120, 31), 16, n_cmpl=2)),
                  loop_marker=PARK_LINE)
    got = ti.result()
    log = srv.log_text()
    assert CONTEXT_ERROR not in log
    assert got.ok, got.error
    assert got.n_predicted == 190
    finals = assert_complete(fam, 2, [120], 16, multi_prompt=False, family=True)
    parks = sorted(f["preempt"]["parks"] for f in finals.values())
    assert parks[0] == 0, parks
    assert parks[1] >= 1, parks
    m = wait_settled(srv.url)
    assert m["n_resume_total"] == m["n_preempt_total"]
    assert m["requests_preempted"] == 0


# no recompute after a context shift ----------------------------------------------------------


def test_a_shifted_slot_is_never_recomputed(start_server: StartServer) -> None:
    """Context shift on, every host copy failing (parks go by recompute), the parked head waits 0
    s before a shifting resident is rotated out. A slot that has shifted holds cells that carry
    what its discarded tokens contributed; a recompute replays only the kept tokens and the
    answer changes. Rotation parked exactly those slots, by recompute when they could not be
    swapped. Now a shifted slot is parked by swap or not at all: no slot is recomputed after its
    first shift, and the requests still complete."""
    srv = start_server(args=[*BASE, *PARK, "-c", "256", "-np", "2", "--context-shift"],
                       env={**FAIL_SAVE, **ROTATE_NOW})
    n = 900
    together = bounded(srv, lambda: complete_many(srv.url, [token_prompt(8, 81),
                                                            token_prompt(8, 82)], n),
                       loop_marker=PARK_LINE, loop_max=400)
    for c in together:
        assert c.ok, c.error
        assert c.n_predicted == n
    log = srv.log_text()
    shifted: set[int] = set()
    for line in log.splitlines():
        if " | task " not in line:
            continue
        task = int(line.split(" | ")[1].split()[1])
        if "slot context shift" in line:
            shifted.add(task)
        elif PARK_LINE in line and "recompute on resume" in line:
            assert task not in shifted, f"task {task} was recomputed after a context shift: {line}"
    assert shifted, "no context shift happened"
    assert count_lines(log, PARK_LINE) >= 1, "nothing was parked"
    wait_settled(srv.url)


# /metrics while the server sleeps -------------------------------------------------------------


@pytest.mark.parametrize("preempt", [False, True], ids=["preempt-off", "preempt-on"])
def test_metrics_read_the_same_asleep_as_awake(start_server: StartServer, preempt: bool) -> None:
    """llama.cpp's own test_sleep.py::test_server_sleep_read_only_endpoints: while the server
    sleeps, /metrics is served from a snapshot and must read exactly as it did awake (after a
    scrape that reset the throughput buckets). kv_cells_total read the pool awake and 0
    asleep."""
    srv = start_server(args=[*BASE, "-c", "256", "-np", "2", "--sleep-idle-seconds", "1",
                             *(PARK if preempt else [])])
    r = httpx.post(f"{srv.url}/completion", json=completion_body(token_prompt(8, 5), 4,
                                                                 stream=False), timeout=60)
    assert r.status_code == 200, r.text[:400]
    httpx.get(f"{srv.url}/metrics", timeout=10).raise_for_status()
    awake = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert "llamacpp:kv_cells_total 256" in awake
    wait_for(lambda: httpx.get(f"{srv.url}/props", timeout=10).json()["is_sleeping"],
             what="the server asleep", timeout=60, interval=0.1)
    asleep = httpx.get(f"{srv.url}/metrics", timeout=10).text
    differ = sorted(set(asleep.splitlines()) ^ set(awake.splitlines()))
    assert asleep == awake, differ
    assert httpx.get(f"{srv.url}/props", timeout=10).json()["is_sleeping"]


# priority with preemption off ---------------------------------------------------------------


@pytest.mark.parametrize("value", [1.5, "high", 2e6, 3])
def test_priority_is_not_read_with_preemption_off(start_server: StartServer,
                                                  value: object) -> None:
    """--preempt-ram 0 is upstream: stock llama-server does not know "priority" and answers 200
    whatever it holds; so must the patched one (it answered 400 for 1.5, "high" and 2e6)."""
    srv = start_server(args=[*BASE, "-c", "256", "-np", "2", "--preempt-ram", "0"])
    r = httpx.post(f"{srv.url}/completion", timeout=60,
                   json=completion_body(token_prompt(8, 6), 4, stream=False, priority=value))
    assert r.status_code == 200, r.text[:400]
    assert "preempt" not in r.json()


# requests behind the parked line: first come, first served; not silent; restore refused -------


def launched_tasks(log: str) -> list[int]:
    """Task ids in the order their slots started them."""
    return [task for _, task in slot_lines(log, "processing task, is_child")]


def park_behind_a_resident(srv: LlamaServer) -> list[RawStream]:
    """A resident A (116 prompt tokens, priority 1: never the victim) that generates without end
    (the server has context shift on: a shift leaves it 129 of the 256 cells), and B (125 prompt
    tokens), which the pool cannot hold beside A a few tokens in: B is parked, or waits to
    prefill, with more than 119 cells, so it stays parked until the test cuts both streams
    (cancel()), on a model of any speed. Returns once a slot is parked."""
    pair = [RawStream(srv.url, token_prompt(116, 50), -1, priority=1),
            RawStream(srv.url, token_prompt(125, 51), 24)]
    wait_for(lambda: any(s.get("is_preempted") for s in slots(srv.url)), what="a parked slot",
             timeout=240)  # a condition, not a time limit
    return pair


def test_requests_behind_the_parked_line_come_back_in_arrival_order(
    start_server: StartServer, slow_model: Path,
) -> None:
    """C, D and E arrive one after the other while a slot is parked (a slot is free for each):
    they wait behind the parked line and must start in arrival order once it is empty (they
    started C, E, D: the pop put each task in front of the one popped before it)."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "256", "-np", "5",
                                               "--context-shift"])
    pair = park_behind_a_resident(srv)
    before = launched_tasks(srv.log_text())
    late: list[threading.Thread] = []
    for seed in (60, 61, 62):
        t = threading.Thread(target=lambda s=seed: stream_sse(
            f"{srv.url}/completion", completion_body(token_prompt(8, s), 8, stream=True)),
            daemon=True)
        t.start()
        late.append(t)
        # the next one is sent once this one waits in the queue (requests_deferred), so the
        # arrival order is the order sent
        n_late = len(late)

        def deferred(n: int = n_late) -> bool:
            return metrics(srv.url)["requests_deferred"] >= n

        wait_for(deferred, what=f"{n_late} deferred requests", timeout=60)
    # the pair's clients go away: the parked line empties (B is dropped)
    for stream in pair:
        stream.cancel()
    for t in late:
        t.join(120)
    started = [task for task in launched_tasks(srv.log_text()) if task not in before]
    assert len(started) >= 3, started
    newcomers = started[-3:]
    assert newcomers == sorted(newcomers), f"launched in order {newcomers}"
    wait_settled(srv.url)


def test_a_request_waiting_behind_the_parked_line_hears_queued_and_keepalives(
    start_server: StartServer, slow_model: Path,
) -> None:
    """A streaming request that arrives while a slot is parked waits (a slot is free) until the
    parked head is restored. From its client's side it is parked: its stream opens at once with
    ": queued" and carries a keepalive at least every --preempt-keepalive seconds (1 here, plus
    1 s of reader slack) until its first data (it used to get no byte at all: no headers, no
    keepalive)."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "256", "-np", "3",
                                               "--preempt-keepalive", "1"])
    pair = park_a_pair(srv)
    newcomer = stream_sse(f"{srv.url}/completion",
                          completion_body(token_prompt(8, 52), 8, stream=True))
    parked = next(log for log in pair.result()
                  if any(line.startswith(": resumed") for _, line in log.lines))
    assert parked.status == newcomer.status == 200
    assert len(newcomer.tokens()) == 8
    lines = newcomer.lines
    assert lines, "nothing streamed"
    assert lines[0][1] == ": queued", lines[:3]
    t_first_data = next(t for t, line in lines if line.startswith("data: "))
    t_resumed = next(t for t, line in parked.lines if line.startswith(": resumed"))
    # both clocks start at their own request: compare on one
    assert newcomer.t_start + lines[0][0] < parked.t_start + t_resumed, (
        "': queued' came after the parked head resumed")
    waiting = [t for t, line in lines if t <= t_first_data]
    gaps = [b - a for a, b in itertools.pairwise(waiting)]
    assert all(line in (": queued", ": preempt-keepalive")
               for t, line in lines if t < t_first_data), lines[:10]
    # a wait longer than the interval and the reader's slack must have heard a keepalive (one
    # just over 1 s may end with its first data before the keepalive due then)
    if t_first_data > 1 + 1:
        assert count_lines("\n".join(line for _, line in lines), ": preempt-keepalive") >= 1
    assert max(gaps, default=0.0) <= 1 + 1, gaps
    # data is byte for byte what it is without the wait: the notice and keepalives are comments
    assert newcomer.final()["tokens_predicted"] == 8
    wait_settled(srv.url)


@pytest.mark.parametrize("bad", ["oversized", "grammar"])
def test_a_request_that_fails_at_launch_keeps_its_4xx_behind_the_parked_line(
    start_server: StartServer, slow_model: Path, bad: str,
) -> None:
    """`: queued` opens a waiting request's stream. A request whose launch fails at once (a
    prompt longer than the context, a grammar the sampler cannot parse) must still get its plain
    4xx, not 200 and an error inside the stream (before `: queued` existed it waited silently
    and got the 4xx at launch; the first build with `: queued` answered 200 + an in-stream error
    for the oversized prompt, which test_preempt_kv.py's seeded soak caught)."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "256", "-np", "3",
                                               "--context-shift"])
    pair = park_behind_a_resident(srv)
    extra: dict[str, Any] = {"grammar": "root ::= ("} if bad == "grammar" else {}
    prompt = token_prompt(300 if bad == "oversized" else 8, 53)
    run = Background(lambda: stream_sse(f"{srv.url}/completion",
                                        completion_body(prompt, 8, stream=True, **extra)))
    # it waits behind the parked line (or is answered before); then the pair's clients go away
    # and the line empties (B is dropped)
    wait_for(lambda: not run.thread.is_alive() or metrics(srv.url)["requests_deferred"] >= 1,
             what="the late request waiting", timeout=60)
    for stream in pair:
        stream.cancel()
    late = run.result(120)
    assert 400 <= late.status < 500, (late.status, late.lines[:3])
    assert not any(line == ": queued" for _, line in late.lines), late.lines[:3]
    wait_settled(srv.url)


def test_a_slot_restore_is_refused_while_a_request_is_parked(start_server: StartServer,
                                                             slow_model: Path,
                                                             tmp_path: Path) -> None:
    """/slots/N?action=restore into an idle slot while another request is parked answered 200,
    and the planner then dropped the restored cache (an idle slot's cache is the first room it
    frees for the parked head). It is refused with a 400 that says why; once nothing is parked
    the same restore is accepted."""
    srv = start_server(model=slow_model, args=[*BASE, *PARK, "-c", "256", "-np", "3",
                                               "--context-shift", "--slot-save-path",
                                               str(tmp_path)])
    r = httpx.post(f"{srv.url}/completion", timeout=120,
                   json=completion_body(token_prompt(8, 7), 4, stream=False, cache_prompt=True,
                                        id_slot=2))
    assert r.status_code == 200, r.text[:400]
    saved = httpx.post(f"{srv.url}/slots/2?action=save", json={"filename": "s2.bin"}, timeout=60)
    assert saved.status_code == 200, saved.text[:400]
    httpx.post(f"{srv.url}/slots/2?action=erase", timeout=60).raise_for_status()

    pair = park_behind_a_resident(srv)
    idle = [s["id"] for s in slots(srv.url) if not s["is_processing"]]
    assert idle, "no idle slot"
    refused = httpx.post(f"{srv.url}/slots/{idle[0]}?action=restore",
                         json={"filename": "s2.bin"}, timeout=60)
    parked_then = any(s.get("is_preempted") for s in slots(srv.url))
    for stream in pair:
        stream.cancel()
    assert parked_then, "the park ended before the restore was asked: no test"
    assert 400 <= refused.status_code < 500, refused.text[:400]
    assert "parked" in refused.json()["error"]["message"]
    wait_settled(srv.url)
    accepted = httpx.post(f"{srv.url}/slots/{idle[0]}?action=restore",
                          json={"filename": "s2.bin"}, timeout=60)
    assert accepted.status_code == 200, accepted.text[:400]
    assert accepted.json()["n_restored"] > 0
