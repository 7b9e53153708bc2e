"""Read a GGUF file's metadata (the key/value header) without loading the model.

`up` uses it to say which model it serves and whether that model carries a chat template.
Only the header is read: keys, and values up to the first tensor description. Arrays (the
vocabulary is one, tens of thousands of strings) are skipped, not kept.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

__all__ = ["GGUFError", "chat_template", "read_metadata"]

MAGIC = b"GGUF"
# value type -> struct format of one scalar (8 = string and 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
STRING, ARRAY = 8, 9
Value = str | int | float | bool | None


class GGUFError(ValueError):
    """The file is not a GGUF file (or is cut short)."""


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError("file ends inside the GGUF header")
    return data


def _unpack(f: BinaryIO, fmt: str) -> int | float | bool:
    value: int | float | bool = struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    return value


def _string(f: BinaryIO) -> str:
    n = int(_unpack(f, "<Q"))
    return _read(f, n).decode("utf-8", "replace")


def _value(f: BinaryIO, vtype: int) -> Value:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])
    if vtype == STRING:
        return _string(f)
    if vtype == ARRAY:
        etype, count = int(_unpack(f, "<I")), int(_unpack(f, "<Q"))
        if etype in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
        else:
            for _ in range(count):
                _value(f, etype)
        return None  # arrays are skipped
    raise GGUFError(f"unknown GGUF value type {vtype}")


def read_metadata(path: Path) -> dict[str, Value]:
    """The header's key/value pairs (arrays appear as None)."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file")
        version = int(_unpack(f, "<I"))
        if version < 2:
            raise GGUFError(f"{path}: GGUF version {version} is too old")
        _unpack(f, "<Q")  # tensor count
        n_kv = int(_unpack(f, "<Q"))
        meta: dict[str, Value] = {}
        for _ in range(n_kv):
            key = _string(f)
            meta[key] = _value(f, int(_unpack(f, "<I")))
        return meta


def chat_template(meta: dict[str, Value]) -> str | None:
    """The model's own chat template (`tokenizer.chat_template`), if it has one."""
    value = meta.get("tokenizer.chat_template")
    return value if isinstance(value, str) and value.strip() else None
