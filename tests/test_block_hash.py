"""kvscope's chain hash against vLLM's own block hash: reproduced on a real vLLM 0.32 capture, cross-checked with
vLLM's hashing code, and the configurations where vLLM's hash cannot be reproduced.

vLLM's functions are run from the installed vLLM's source (``vllm/v1/core/kv_cache_utils.py``: the seed rules
and ``hash_block_tokens``; ``vllm/utils/hashing.py``: the hash functions), compiled on their own: importing the
module pulls in torch and the engine (~20 s), and these functions need none of it.
"""

from __future__ import annotations
import __future__

import ast
import base64
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from collector.events import KvBlockEvent
from collector.kv_chains import BlockChains
from collector.kv_decode import message_events
from kvscope.block_hash import (
    DEFAULT_SEED,
    block_digests,
    chain_hashes,
    external,
    hash_function,
    none_hash,
    salt_keys,
)

CAPTURE = Path(__file__).parent / "samples" / "vllm_0.32.0_cpu_real_kv_events.json"
VLLM = Path(str(importlib.util.find_spec("vllm").origin)).parent  # found, not imported


def capture() -> list[dict[str, Any]]:
    return json.loads(CAPTURE.read_text())


def frames(message: dict[str, Any]) -> list[bytes]:
    """The capture's message as the ZMQ frames vLLM sent: [topic, seq (8 bytes big-endian), msgpack payload]."""
    return [message["topic"].encode(), message["seq"].to_bytes(8, "big"), base64.b64decode(message["payload_b64"])]


def vllm_hashing() -> tuple[ModuleType, dict[str, Any]]:
    """vLLM's ``vllm/utils/hashing.py`` as a module, and the namespace of the block-hash functions of
    ``vllm/v1/core/kv_cache_utils.py`` (DEFAULT_NONE_HASH_SEED, resolve_none_hash_seed, init_none_hash,
    hash_block_tokens, ...) compiled from vLLM's source."""
    spec = importlib.util.spec_from_file_location("vllm_hashing_src", VLLM / "utils" / "hashing.py")
    assert spec is not None and spec.loader is not None
    hashing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hashing)
    path = VLLM / "v1" / "core" / "kv_cache_utils.py"
    wanted = {"DEFAULT_NONE_HASH_SEED", "_NON_CRYPTO_HASH_FUNCTIONS", "_NONE_HASH_SEED", "resolve_none_hash_seed",
              "init_none_hash", "hash_block_tokens", "generate_block_hash_extra_keys", "_gen_mm_extra_hash_keys",
              "_gen_lora_extra_hash_keys", "_gen_prompt_embeds_extra_hash_keys", "to_event_extra_keys"}
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body
             if (isinstance(n, ast.FunctionDef) and n.name in wanted)
             or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in wanted for t in n.targets))
             or (isinstance(n, ast.AnnAssign) and n.value is not None and isinstance(n.target, ast.Name)
                 and n.target.id in wanted)]
    ns: dict[str, Any] = {"os": os, "hashlib": hashlib, "xxhash": hashing.xxhash, "xxhash_cbor": hashing.xxhash_cbor,
                          "BlockHash": bytes, "logger": logging.getLogger("vllm-source")}
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, ns)  # noqa: S102 - vLLM's own source, read from the installed package
    assert wanted <= set(ns), "vLLM renamed its block-hash functions: re-check kvscope/block_hash.py"
    return hashing, ns


def test_chain_hashes_reproduce_vllms_block_hashes_on_the_real_capture() -> None:
    """Every block of the capture (six BlockStored events, 52 blocks, prompts and decode-filled blocks whose
    parent is in an earlier event): SHA-256 over pickle, seed "vllm-none-hash", low 64 bits, chained from
    the parent's full digest = the hash vLLM published. So a gateway that knows a prompt's token ids computes
    the hashes the pod will publish."""
    digests: dict[int, bytes] = {}
    blocks = 0
    for m in capture():
        (event,) = m["decoded"][1]
        assert event["type"] == "BlockStored" and event["extra_keys"] == [None] * len(event["block_hashes"])
        parent = None if event["parent_block_hash"] is None else digests[event["parent_block_hash"]]
        got = block_digests(event["token_ids"], event["block_size"], parent)
        assert [external(d) for d in got] == event["block_hashes"], m["seq"]
        digests.update(zip(event["block_hashes"], got, strict=True))
        blocks += len(got)
    assert blocks == 52
    first = capture()[0]["decoded"][1][0]
    assert chain_hashes(first["token_ids"], 32) == first["block_hashes"]  # the gateway's call: a prompt from its start
    assert chain_hashes(first["token_ids"] + [7] * 31, 32) == first["block_hashes"]  # a partial block is not hashed


def test_the_collector_publishes_chain_hashes_instead_of_token_ids() -> None:
    """The capture's frames through the collector's decoder and :class:`BlockChains`: token ids leave the event,
    their count and one chain hash per block stay; on this default-configured pod the chain hashes are vLLM's."""
    chains = BlockChains()
    for m in capture():
        raw = m["decoded"][1][0]
        (batch,) = message_events(frames(m))  # no dead letter
        env = chains.envelope(batch)
        (e,) = env.payload.events
        assert e.token_ids == [] and e.token_count == len(raw["token_ids"])
        assert e.chain_hashes == e.block_hashes == raw["block_hashes"]
        assert env.event_id == message_events(frames(m))[0].event_id
    assert len(chains) == 52


def test_a_continuation_whose_parent_was_never_seen_has_unknown_chain_hashes() -> None:
    m = capture()[1]  # seq 11: one decode-filled block on top of the first prompt's last block
    (e,) = BlockChains().envelope(message_events(frames(m))[0]).payload.events
    assert e.parent_block_hash is not None and e.chain_hashes == [0] and e.token_count == 32


def test_vllm_source_hash_block_tokens_equals_kvscope(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own init_none_hash + hash_block_tokens for sha256 and sha256_cbor, seed unset and seed set."""
    hashing, v = vllm_hashing()
    tokens = list(range(1000, 1100))
    for algo, fn in (("sha256", hashing.sha256), ("sha256_cbor", hashing.sha256_cbor)):
        for seed in (None, "42"):
            if seed is None:
                monkeypatch.delenv("PYTHONHASHSEED", raising=False)
            else:
                monkeypatch.setenv("PYTHONHASHSEED", seed)
            v["init_none_hash"](fn)
            want, parent = [], None
            for i in range(3):
                parent = v["hash_block_tokens"](fn, parent, tokens[i * 32:(i + 1) * 32], None)
                want.append(parent)
            assert block_digests(tokens, 32, algo=algo, seed=seed) == want, (algo, seed)
            assert v["NONE_HASH"] == none_hash(algo, seed)
    assert v["DEFAULT_NONE_HASH_SEED"] == DEFAULT_SEED


def test_a_pod_with_pythonhashseed_set_publishes_other_hashes_and_the_chain_still_names_the_prefix() -> None:
    """PYTHONHASHSEED=42 on the pod: vLLM's hashes differ from kvscope's chain hashes, yet BlockChains still
    gives each block (a continuation too, through the parent's vLLM hash) the chain hash the gateway computes."""
    tokens = list(range(96))
    pod = [external(d) for d in block_digests(tokens, 32, seed="42")]
    chains = BlockChains()
    first = chains.event(KvBlockEvent(type="BlockStored", block_hashes=pod[:2], token_ids=tokens[:64], block_size=32))
    more = chains.event(KvBlockEvent(type="BlockStored", block_hashes=pod[2:], parent_block_hash=pod[1],
                                     token_ids=tokens[64:], block_size=32))
    assert first.chain_hashes + more.chain_hashes == chain_hashes(tokens, 32) != pod


def test_xxhash_pods_are_not_reproducible_without_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's seed rule: the SHA-256 algorithms use the fixed "vllm-none-hash"; xxhash and xxhash_cbor draw 32
    random bytes per process unless PYTHONHASHSEED is set, so no one outside the pod can compute its hashes.
    kvscope refuses them (its chain hashes still work there: they never depend on the pod's algorithm)."""
    hashing, v = vllm_hashing()
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    resolve = v["resolve_none_hash_seed"]
    assert resolve(hashing.sha256) == resolve(hashing.sha256_cbor) == DEFAULT_SEED
    seeds = {resolve(hashing.xxhash) for _ in range(3)}
    assert len(seeds) == 3 and DEFAULT_SEED not in seeds
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert resolve(hashing.xxhash) == "7"
    for algo in ("xxhash", "xxhash_cbor", "md5"):
        with pytest.raises(ValueError, match="xxhash|unknown"):
            hash_function(algo)
    with pytest.raises(ValueError, match="block_size"):
        block_digests([1, 2], 0)


def vllm_request_hashes(v: dict[str, Any], tokens: list[int], block_size: int, *, cache_salt: str | None = None,
                        lora: tuple[str, str] | None = None, mm: list[tuple[str, int, int]] = ()
                        ) -> tuple[list[bytes], list[tuple[Any, ...] | None]]:
    """vLLM's own block hashes of a request's full blocks and its per-block extra keys, from the installed source:
    ``generate_block_hash_extra_keys`` (its request reduced to the attributes that function reads: cache_salt,
    lora_request, mm_features, prompt_embeds) and ``hash_block_tokens`` with SHA-256, default seed. ``mm``:
    (identifier, offset, length) of each multimodal item."""
    from types import SimpleNamespace

    hashing, _ = vllm_hashing()
    v["init_none_hash"](hashing.sha256)
    request = SimpleNamespace(
        cache_salt=cache_salt, prompt_embeds=None,
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora[0], lora_path=lora[1]),
        mm_features=[SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n))
                     for i, o, n in mm])
    hashes, keys, parent, mm_idx = [], [], None, 0
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        extra, mm_idx = v["generate_block_hash_extra_keys"](request, start, start + block_size, mm_idx)
        parent = v["hash_block_tokens"](hashing.sha256, parent, tokens[start:start + block_size], extra)
        hashes.append(parent)
        keys.append(extra)
    return hashes, keys


def test_a_salted_prompt_chain_equals_vllms_salted_block_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keys ``("cache_salt", salt)`` into the first block only; kvscope's chain with the salt equals vLLM's
    hash of every block (so, on a default pod, the hashes the pod publishes), and differs from the unsalted
    chain and another salt's in every block (the salt reaches later blocks through their parents)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    _, v = vllm_hashing()
    tokens = list(range(500, 600))
    want, keys = vllm_request_hashes(v, tokens, 16, cache_salt="tenant-a")
    assert keys[0] == salt_keys("tenant-a") == (("cache_salt", "tenant-a"),) and keys[1:] == [None] * 5
    salted = chain_hashes(tokens, 16, cache_salt="tenant-a")
    assert salted == [external(d) for d in want]
    other, plain = chain_hashes(tokens, 16, cache_salt="tenant-b"), chain_hashes(tokens, 16)
    assert all(a != b and a != c for a, b, c in zip(salted, other, plain, strict=True))
    assert chain_hashes(tokens, 16, cache_salt="") == plain == [external(d) for d in vllm_request_hashes(
        v, tokens, 16)[0]]
    with pytest.raises(ValueError, match="prompt's start only"):
        chain_hashes(tokens, 16, parent=none_hash(), cache_salt="tenant-a")
    with pytest.raises(ValueError, match="prompt's start only"):
        chain_hashes(tokens, 16, parent=none_hash(), lora_name="ad-1")


def stored_frames(events: list[dict[str, Any]], seq: int, topic: str = "pod-0") -> list[bytes]:
    """ZMQ frames of one vLLM 0.32 batch (``[ts, [events...], dp_rank]`` msgpack, each event a map with "type")."""
    import msgspec

    payload = msgspec.msgpack.encode([1.7e9 + seq, [{"type": "BlockStored", **e} for e in events], 0])
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def test_the_collector_chains_salted_blocks_as_vllm_and_the_gateway_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """BlockStored events whose blocks and extra_keys come from vLLM's own hashing code (generate_block_hash_extra_keys,
    to_event_extra_keys, hash_block_tokens): a salted prompt and its continuation get chain hashes equal to vLLM's
    published hashes and to the gateway's salted chain; the salt is nowhere in what the collector publishes. A LoRA
    adapter's blocks chain from the adapter's root (the gateway's chain for it); a multimodal block and everything
    after it is unknown."""
    import msgspec

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    _, v = vllm_hashing()
    secret = "user-31-Kq9v"
    tokens = list(range(3000, 3100))  # 6 full blocks of 16, 4 left over
    hashes, keys = vllm_request_hashes(v, tokens, 16, cache_salt=secret)
    wire = [int(external(h)) for h in hashes]
    event_keys = v["to_event_extra_keys"](keys)
    assert event_keys == [(secret,)] + [None] * 5  # vLLM publishes the bare salt on the first block
    chains = BlockChains()
    first = {"block_hashes": wire[:4], "parent_block_hash": None, "token_ids": tokens[:64], "block_size": 16,
             "medium": "GPU", "extra_keys": event_keys[:4]}
    more = {"block_hashes": wire[4:], "parent_block_hash": wire[3], "token_ids": tokens[64:96], "block_size": 16,
            "medium": "GPU", "extra_keys": event_keys[4:]}
    got = []
    for seq, event in enumerate((first, more)):
        (env,) = message_events(stored_frames([event], seq))
        env = chains.envelope(env)
        assert secret.encode() not in msgspec.json.encode(env)
        (e,) = env.payload.events
        assert e.extra_keys is None and e.token_ids == []
        got += e.chain_hashes
    assert got == wire == chain_hashes(tokens, 16, cache_salt=secret) != chain_hashes(tokens, 16)

    lora_hashes, lora_keys = vllm_request_hashes(v, tokens, 16, cache_salt=secret, lora=("ad-1", "/models/ad-1"))
    lora_event = {"block_hashes": [external(h) for h in lora_hashes], "parent_block_hash": None,
                  "token_ids": tokens[:96],
                  "block_size": 16, "lora_name": "ad-1", "extra_keys": v["to_event_extra_keys"](lora_keys)}
    assert lora_event["extra_keys"][:2] == [("ad-1", secret), ("ad-1",)]
    (env,) = message_events(stored_frames([lora_event], 0, "pod-1"))
    lora_chain = chains.envelope(env).payload.events[0].chain_hashes
    # rooted at the adapter, as the gateway roots a prompt the pod served with it: apart from the base model's
    # blocks of the same tokens (vLLM never shares them), and not vLLM's own (it keys the adapter's path too)
    assert lora_chain == chain_hashes(tokens, 16, cache_salt=secret, lora_name="ad-1")
    assert not set(lora_chain) & set(got) and not set(lora_chain) & set(lora_event["block_hashes"])
    assert 0 not in lora_chain and lora_chain != chain_hashes(tokens, 16, cache_salt=secret, lora_name="ad-2")
    lora_more = {"block_hashes": [91, 92], "parent_block_hash": lora_event["block_hashes"][-1],
                 "token_ids": list(range(5000, 5032)), "block_size": 16, "lora_name": "ad-1"}
    (env,) = message_events(stored_frames([lora_more], 1, "pod-1"))
    assert chains.envelope(env).payload.events[0].chain_hashes == chain_hashes(
        tokens[:96] + lora_more["token_ids"], 16, cache_salt=secret, lora_name="ad-1")[6:]

    mm_hashes, mm_keys = vllm_request_hashes(v, tokens, 16, mm=[("img-7", 20, 30)])  # tokens 20..49: blocks 1-3
    mm_wire = [external(h) for h in mm_hashes]
    mm_event = {"block_hashes": mm_wire[:5], "parent_block_hash": None, "token_ids": tokens[:80], "block_size": 16,
                "extra_keys": v["to_event_extra_keys"](mm_keys[:5])}
    assert mm_event["extra_keys"][:3] == [None, (("img-7", 4),), (("img-7", -12),)]
    after = {"block_hashes": mm_wire[5:], "parent_block_hash": mm_wire[4], "token_ids": tokens[80:96],
             "block_size": 16}
    envs = [chains.envelope(message_events(stored_frames([e], s, "pod-2"))[0]) for s, e in enumerate((mm_event, after))]
    assert envs[0].payload.events[0].chain_hashes == [mm_wire[0], 0, 0, 0, 0]  # block 0 has no keys: vLLM's hash
    assert envs[1].payload.events[0].chain_hashes == [0]  # its parent is unknown


def test_extra_keys_kvscope_cannot_tag_make_the_chain_unknown() -> None:
    """Per block: a salt on a block other than the request's first, a prompt-embeds digest (bytes), a LoRA name that
    is not the event's, a salt beside another string, or a count of entries that is not one per block: chain hash 0
    from that block on; no entry, or [None] per block, is the plain chain."""
    tokens = list(range(64))
    plain = chain_hashes(tokens, 16)
    cases = [
        ([None, ("s",), None, None], None, None, 1),
        ([(b"\x01" * 32,), None, None, None], None, None, 0),
        ([("other", "s"), None, None, None], "ad", None, 0),
        ([("s", "t"), None, None, None], None, None, 0),
        ([None, None], None, None, 0),
        (None, None, None, 4),
        ([None] * 4, "ad", None, 4),
    ]
    for keys, lora, parent, known in cases:
        e = KvBlockEvent(type="BlockStored", block_hashes=[11, 12, 13, 14], parent_block_hash=parent, token_ids=tokens,
                         block_size=16, lora_name=lora, extra_keys=keys)
        got = BlockChains().event(e)
        expected = chain_hashes(tokens, 16, lora_name=lora) if lora else plain
        assert got.chain_hashes == expected[:known] + [0] * (4 - known), keys
        assert got.extra_keys is None
