"""collector.msgpack_split: the failure path of a KV-event batch splits msgpack arrays without decoding them;
every split must give back exactly the bytes msgspec encodes for each element, whatever the types and depth."""

from __future__ import annotations

import random

import msgspec
import pytest

from collector.msgpack_split import MsgpackSplitError, skip, split_array

VALUES = [0, 127, 128, -1, -32, -33, 2**16, 2**32, 2**63, -(2**63), 1.5, float("inf"), "", "x" * 31, "x" * 32,
          "é" * 40_000, b"", b"y" * 300, b"z" * 70_000, None, True, False, [], {}, [1, [2, [3, {"k": [None]}]]],
          {"a": {"b": [None, True, False]}, 1: 2}, list(range(20)), {str(i): i for i in range(20)},
          list(range(70_000)), msgspec.msgpack.Ext(5, b"abc"), *(msgspec.msgpack.Ext(1, b"a" * n)
                                                                 for n in (1, 2, 4, 8, 16, 17, 300, 70_000))]


def test_each_element_comes_back_as_its_own_bytes() -> None:
    rng = random.Random(7)
    for _ in range(300):
        items = [rng.choice(VALUES) for _ in range(rng.randint(0, 20))]
        parts = split_array(msgspec.msgpack.encode(items))
        assert parts == [msgspec.msgpack.encode(v) for v in items]
        assert [msgspec.msgpack.decode(p) for p in parts] == items


def test_nesting_deeper_than_any_recursion_limit_is_skipped() -> None:
    deep = b"\x91" * 500_000 + b"\x01"
    assert skip(deep, 0) == len(deep)
    assert split_array(b"\x92" + deep + b"\x02") == [deep, b"\x02"]


@pytest.mark.parametrize("buf", [b"", b"\x01", b"\x92\x01", b"\x91\xc1", b"\x91\xd9\x05ab", b"\x91\x01\x02",
                                 b"\xdd\xff\xff\xff\xff\x01", b"\x91\xdc\x00"])
def test_what_is_not_one_whole_array_is_refused(buf: bytes) -> None:
    with pytest.raises(MsgpackSplitError):
        split_array(buf)
