"""Error hierarchy and map_exceptions."""

from __future__ import annotations

import h11
import pytest

from sidecar.core import errors as E


@pytest.mark.parametrize(
    ("cls", "status"),
    [
        (E.BadRequest, 400),
        (E.Unauthorized, 401),
        (E.RequestTimeout, 408),
        (E.PayloadTooLarge, 413),
        (E.HeadersTooLarge, 431),
        (E.UnsupportedFraming, 501),
        (E.UpstreamConnectError, 502),
        (E.UpstreamTimeout, 504),
        (E.UpstreamDisconnected, 502),
        (E.UpstreamProtocolError, 502),
    ],
)
def test_status_hints(cls: type[E.SidecarError], status: int) -> None:
    assert cls.status_hint == status
    assert issubclass(cls, E.SidecarError)


@pytest.mark.parametrize(
    ("hint", "cls"), [(400, E.BadRequest), (431, E.HeadersTooLarge), (501, E.UnsupportedFraming)]
)
def test_map_h11_keeps_status_hint(hint: int, cls: type[E.ClientError]) -> None:
    with pytest.raises(cls), E.map_exceptions({h11.RemoteProtocolError: E.ClientError}):
        raise h11.RemoteProtocolError("x", error_status_hint=hint)


def test_map_other_and_passthrough() -> None:
    with pytest.raises(E.UpstreamConnectError), E.map_exceptions({OSError: E.UpstreamConnectError}):
        raise ConnectionRefusedError("nope")
    with pytest.raises(KeyError), E.map_exceptions({OSError: E.UpstreamConnectError}):
        raise KeyError("unmapped")
    with pytest.raises(E.PayloadTooLarge), E.map_exceptions({Exception: E.BadRequest}):
        raise E.PayloadTooLarge("kept")
