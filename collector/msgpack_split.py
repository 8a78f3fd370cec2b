"""Split a msgpack array into the bytes of its elements without decoding them, iteratively (no recursion).

Used only when a KV-event batch fails to decode as a whole and msgspec cannot split it either (an element nested
deeper than the decoder's recursion limit): each element is then decoded alone, so the bad one costs only itself.
Formats from the msgpack specification (https://github.com/msgpack/msgpack/blob/master/spec.md, "Formats").
"""

from __future__ import annotations

import struct


class MsgpackSplitError(ValueError):
    """The bytes are not one msgpack array: not an array, truncated, the unused type 0xc1, or bytes after it."""


#: First byte → (bytes of its length field, extra fixed bytes after the length field, what the length counts:
#: "bytes" of payload, "items" (array elements) or "pairs" (map entries, two items each)).
_SIZED: dict[int, tuple[int, int, str]] = {
    0xC4: (1, 0, "bytes"), 0xC5: (2, 0, "bytes"), 0xC6: (4, 0, "bytes"),  # bin 8/16/32
    0xC7: (1, 1, "bytes"), 0xC8: (2, 1, "bytes"), 0xC9: (4, 1, "bytes"),  # ext 8/16/32 (+ 1 type byte)
    0xD9: (1, 0, "bytes"), 0xDA: (2, 0, "bytes"), 0xDB: (4, 0, "bytes"),  # str 8/16/32
    0xDC: (2, 0, "items"), 0xDD: (4, 0, "items"),  # array 16/32
    0xDE: (2, 0, "pairs"), 0xDF: (4, 0, "pairs"),  # map 16/32
}
#: First byte → total size of a fixed-size value (nil, bools, floats, ints, fixext).
_FIXED: dict[int, int] = {
    0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
    0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18,
}
_LENGTH = {1: ">B", 2: ">H", 4: ">I"}


def _header(buf: bytes, pos: int) -> tuple[int, int]:
    """(position after the value's header and any payload bytes, child items that follow) of the value at ``pos``."""
    if pos >= len(buf):
        raise MsgpackSplitError(f"truncated at byte {pos}")
    first = buf[pos]
    if first <= 0x7F or first >= 0xE0:  # positive / negative fixint
        return pos + 1, 0
    if 0x80 <= first <= 0x8F:  # fixmap
        return pos + 1, 2 * (first & 0x0F)
    if 0x90 <= first <= 0x9F:  # fixarray
        return pos + 1, first & 0x0F
    if 0xA0 <= first <= 0xBF:  # fixstr
        return pos + 1 + (first & 0x1F), 0
    if first in _FIXED:
        return pos + _FIXED[first], 0
    if first in _SIZED:
        width, extra, unit = _SIZED[first]
        if pos + 1 + width > len(buf):
            raise MsgpackSplitError(f"truncated at byte {pos}")
        (size,) = struct.unpack_from(_LENGTH[width], buf, pos + 1)
        after = pos + 1 + width + extra
        if unit == "bytes":
            return after + size, 0
        return after, size * (2 if unit == "pairs" else 1)
    raise MsgpackSplitError(f"byte 0x{first:02x} at {pos} starts no msgpack value")


def skip(buf: bytes, pos: int) -> int:
    """The position just after the msgpack value at ``pos`` in ``buf``, however deeply it nests (a loop over its
    headers, one per value). Raises :class:`MsgpackSplitError` when it is cut short or holds the unused byte 0xc1."""
    pending = 1
    while pending:
        pos, children = _header(buf, pos)
        pending += children - 1
        if pos > len(buf):
            raise MsgpackSplitError("truncated")
    return pos


def split_array(buf: bytes) -> list[bytes]:
    """The msgpack bytes of each element of the array that ``buf`` holds, in order. Raises
    :class:`MsgpackSplitError` when ``buf`` is not exactly one array (another type, truncated, bytes after it)."""
    if not buf:
        raise MsgpackSplitError("empty")
    first = buf[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        pos, count = _header(buf, 0)
    else:
        raise MsgpackSplitError(f"not an array (first byte 0x{first:02x})")
    parts = []
    for _ in range(count):
        end = skip(buf, pos)
        parts.append(buf[pos:end])
        pos = end
    if pos != len(buf):
        raise MsgpackSplitError(f"{len(buf) - pos} bytes after the array")
    return parts
