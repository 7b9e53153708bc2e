"""A headless Chromium (Debian's, driven by Playwright) for the chat page tests.

No browser is downloaded: Playwright's Python package drives the system Chromium
(`apt-get install chromium`) through `executable_path`. Each test gets a fresh browser
context (a profile of its own: empty IndexedDB and localStorage, as a first visit). The
tests skip, saying why, only when Chromium or Playwright is missing; screenshots go to
``LLAMA_SIDECAR_UI_ARTIFACTS`` (default: the test's pytest tmp directory).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The flags of a quiet test browser: nothing it would fetch or update on its own.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None  # type: ignore[assignment]


def _why_not() -> str | None:
    if CHROMIUM is None:
        return "Chromium is not installed (apt-get install chromium)"
    if sync_playwright is None:
        return "Playwright is not installed (pip install -e '.[test]')"
    return None


# Module scope, not session: Playwright's sync API runs an asyncio loop of its own while it is
# open, and the anyio tests that a pytest(-xdist) process may run after these would then fail
# with "Cannot run the event loop while another loop is running".
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    assert sync_playwright is not None
    with sync_playwright() as pw:
        # Playwright gives every launch a fresh temporary --user-data-dir.
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """Where a test keeps its screenshots (git-ignored when under the checkout)."""
    base = os.environ.get("LLAMA_SIDECAR_UI_ARTIFACTS")
    out = Path(base) if base else tmp_path / "artifacts"
    out.mkdir(parents=True, exist_ok=True)
    return out
