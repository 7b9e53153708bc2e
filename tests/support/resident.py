"""A park as long as a test wants, on a model of any speed: an endless resident.

A stream straight to the patched llama-server (its server started with `--context-shift`)
that outranks the test's requests (priority 1: never their victim), has no n_predict and
ignores EOS, so it never ends by itself; a context shift leaves it half the pool, so a request
parked holding more than that cannot come back beside it. It is sent as soon as the test's
first request is on a slot (the requests then meet it at the same size however long their
client takes to start) and cut once one of them has been parked for `hold_s`; a request that
waits to prefill is parked with 0 cells and counts too. Both waits read llama-server's log as
it grows (`processing task`, then the park and resume lines).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.tinymodel import TEXT_TOKENS

PARK_RE = re.compile(r"task (\d+) \| (preempted: |resumed after )")


def token_prompt(n: int, start: int = 0) -> list[int]:
    """n text token ids (a token list gets no BOS), the same for the same arguments."""
    return [TEXT_TOKENS[(start + i * 37) % len(TEXT_TOKENS)] for i in range(n)]


@dataclass
class Resident:
    status: int | None = None  # its response's status
    chunks: int = 0  # body reads before the cut
    cut: bool = False  # cut by the block's end, the hold or the minute
    ended: bool = False  # its stream is over (cut, or ended by itself: an error)


@contextlib.contextmanager
def endless_resident(
    server_url: str, server_log: Path, hold_s: float | None, prompt_tokens: int = 64
) -> Iterator[Resident]:
    """Run the block beside the resident; it is cut once a park has lasted `hold_s` (None: no
    such cut), when the block ends, or after a minute (so that a missing park fails the test's
    own checks rather than hangs it). An error of the resident's own stream fails the test
    after the block."""
    body = {"prompt": token_prompt(prompt_tokens), "n_predict": -1, "ignore_eos": True,
            "priority": 1, "stream": True}  # fmt: skip
    resident = Resident()
    hold = float("inf") if hold_s is None else hold_s
    stop = threading.Event()
    errors: list[BaseException] = []
    log = server_log.open(errors="replace")
    log.seek(0, 2)

    def run() -> None:
        deadline = time.monotonic() + 60
        tail = ""
        while "processing task" not in tail:
            if stop.wait(0.005) or time.monotonic() > deadline:
                return
            tail += log.read()
        tail = tail[tail.index("processing task") :]
        parked: dict[str, float] = {}  # task -> when its park was first seen
        with httpx.stream("POST", server_url + "/completion", json=body,
                          timeout=httpx.Timeout(60, connect=10)) as r:  # fmt: skip
            resident.status = r.status_code
            r.raise_for_status()
            for _ in r.iter_raw():
                resident.chunks += 1
                now = time.monotonic()
                *lines, tail = (tail + log.read()).split("\n")
                for task, what in PARK_RE.findall("\n".join(lines)):
                    if what == "preempted: ":
                        parked.setdefault(task, now)
                    else:
                        parked.pop(task, None)
                held = now - min(parked.values(), default=now)
                if stop.is_set() or now > deadline or held >= hold:
                    resident.cut = True
                    return

    def guarded() -> None:
        try:
            run()
        except BaseException as e:  # reported after the block
            errors.append(e)
        finally:
            resident.ended = True

    th = threading.Thread(target=guarded, daemon=True)
    th.start()
    try:
        yield resident
    finally:
        stop.set()
        th.join(60)
        log.close()
    assert not errors, errors
