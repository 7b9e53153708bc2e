"""``--body-buffer 0`` puts every request body on disk.

``tempfile.SpooledTemporaryFile(max_size=0)`` never rolls over (0 means "no limit" there), so
``--body-buffer 0`` used to keep every body in memory, however large: the opposite of what
an operator who sets it wants.  Now 0 means "on disk from the first byte".  The test holds
the request upstream and looks at the descriptors the process has open while the body is
buffered: an anonymous temporary file is one, a body in memory is none.
"""

from __future__ import annotations

import os
import tempfile

import anyio
import pytest

from sidecar.proxy.upstream import RequestBody
from tests.support.fake_upstream import FakeUpstream
from tests.support.fixtures import SidecarFactory
from tests.support.rawclient import RawConn

pytestmark = [pytest.mark.anyio, pytest.mark.in_memory]

BODY = b"x" * 100_000


def open_temp_files() -> int:
    """Descriptors of this process on deleted files in the temporary directory."""
    tmp = tempfile.gettempdir()
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(tmp) and target.endswith("(deleted)"):
            count += 1
    return count


def test_request_body_with_no_memory_is_a_file_on_disk() -> None:
    before = open_temp_files()
    body = RequestBody(0)
    try:
        body.append(b"a")
        assert open_temp_files() == before + 1
        assert b"".join(body.pieces()) == b"a"
    finally:
        body.close()
    assert open_temp_files() == before


@pytest.mark.parametrize(("body_buffer", "on_disk"), [(0, 1), (1024 * 1024, 0)])
async def test_body_buffer_zero_spills_every_body(
    fake: FakeUpstream, sidecar_factory: SidecarFactory, body_buffer: int, on_disk: int
) -> None:
    fake.route("/hold", [("hang",)])
    async with sidecar_factory(fake.url, body_buffer=body_buffer) as sc:
        before = open_temp_files()
        async with await RawConn.open(sc.url) as c:
            await c.send(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % len(BODY) + BODY)  # fmt: skip
            with anyio.fail_after(10):
                while not fake.requests:
                    await anyio.sleep(0.01)
            assert len(fake.requests[0].body) == len(BODY)
            # the body stays buffered (for a retry) while the exchange runs
            assert open_temp_files() - before == on_disk
        with anyio.fail_after(10):
            while sc.ctx.active:
                await anyio.sleep(0.01)
        assert open_temp_files() == before
