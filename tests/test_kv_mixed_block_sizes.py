"""Pods with different block sizes in precise mode (found on real vLLM pods at --block-size 32 and 64): a pod hashes
each full block of its own size, so the KV events of a pod of another size say nothing about a request's chain. A
request whose predecessor sat on such a pod was answered ``cold`` ("resident nowhere, and that pod's events cover the
arrival"), though the prefix was there; it is ``routed_away``, as without KV events. KV events fed the production
way (ZMQ frames → collector → queue → ingester → chDB)."""

from __future__ import annotations

from typing import Any

import pytest
from test_attribution_job import insert_requests
from test_attribution_precise import gw, tokens
from test_kv_evidence_horizon import attribute
from test_kv_memo_hostile import frames
from test_kv_residency import collect, ingest

from ingest.store import Store
from kvscope.block_hash import chain_hashes

SYSTEM = 384  # tokens of the shared system prompt: 6 blocks of 64, 12 of 32
PROMPT = SYSTEM + 20


def stored(toks: list[int], size: int) -> dict[str, Any]:
    names = chain_hashes(toks, size)
    return {"type": "BlockStored", "block_hashes": names, "parent_block_hash": None,
            "token_ids": toks[: len(names) * size], "block_size": size, "lora_id": None, "medium": "GPU"}


def row(rid: str, t: float, pod: str, prompt_ids: list[int], size: int) -> dict[str, Any]:
    return gw(rid, 81, t=t, pod=pod, prompt_ids=prompt_ids, b=size, prompt=PROMPT, system_tokens=SYSTEM,
              suffix=rid, suffix_tokens=20)


@pytest.mark.parametrize("big", [64, 32])
def test_a_predecessor_on_a_pod_of_another_block_size_is_routed_away_not_cold(
        store: Store, monkeypatch: pytest.MonkeyPatch, big: int) -> None:
    """r0 on pod ``big`` (block size ``big``) stored the prompt; r1, the same system prompt on pod small (block size
    32), missed it all. With 64 the events of big cannot show the chain of r1: routed_away by the fingerprints, big
    named. With 32 (the control) they do: routed_away with big as the holder, from the events."""
    prompt = tokens(81, PROMPT)
    other = tokens(82, 64)
    ingest(store, collect([frames("small", 1, 0.5, stored(other, 32)), frames("big", 1, 1.05, stored(prompt, big))]))
    insert_requests(store, [row("r0", 1.0, "big", prompt, big), row("r1", 5.0, "small", prompt, 32)])
    answers = attribute(store, monkeypatch, 10**6)
    causes, evidence, holder, _ = answers["r1"]
    assert causes == [("routed_away", "", SYSTEM), ("unavoidable", "", PROMPT - SYSTEM)], answers["r1"]
    assert (evidence, holder) == ("kv_events", "" if big != 32 else "big")
