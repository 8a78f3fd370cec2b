"""Names from clients (models, pods) that a hostile or careless client picks, in precise mode: whatever bytes a name
holds and however many names a window holds, a request's KV evidence is the same as with plain names.

Found by trying to break precise mode: the pods that count as holders for a request were keyed by its model and
pods joined with a separator, so a model whose name held that separator took another model's holders; and the
as-of keys of cache resets multiplied name ranks by the window's span of milliseconds, which overflowed int64 with
tens of thousands of model names over weeks (resets were then looked up in an unsorted array)."""

from __future__ import annotations

from typing import Any

import pytest
from test_attribution_job import insert_requests
from test_attribution_precise import tokens
from test_kv_evidence_horizon import attribute
from test_kv_memo_hostile import CLEARED, B, N, frames, request, serving, store_event
from test_kv_residency import collect, ingest

from ingest.store import Store
from kvscope.block_hash import chain_hashes

DAY = 86400.0


@pytest.mark.parametrize("model", ["mx\x1fhp", "my"])
def test_a_model_name_holding_a_separator_does_not_take_another_models_holders(
        store: Store, monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    """Model ``mx`` is served by pods hp and own, ``model`` by own only; hp holds the prompt. r1 (``model``, on own)
    may not name hp (no pod of its model holds the prefix: cold); r2 (mx, on own) names hp (routed_away)."""
    sc = 71
    prompt, other = tokens(sc, N * B), tokens(sc, B, 9)
    ingest(store, collect([frames("hp", 1, 1.0, store_event(prompt, chain_hashes(prompt, B))),
                           frames("own", 1, 0.5, store_event(other, chain_hashes(other, B)))]))
    insert_requests(store, [
        {**serving(sc, "hp"), "request_id": "serve-hp-mx", "model": "mx"},
        {**serving(sc, "own", t=0.2), "request_id": "serve-own-mx", "model": "mx"},
        {**serving(sc, "own", t=0.3), "request_id": "serve-own-m1", "model": model},
        {**request("r1", sc, 5.0, "own", prompt), "model": model},
        {**request("r2", sc, 5.0, "own", prompt), "model": "mx", "tenant_id": "other"},
    ])
    whole, each = attribute(store, monkeypatch, 10**6), attribute(store, monkeypatch, 1)
    assert whole == each
    assert whole["r1"][0][0][0] == "cold"
    assert whole["r2"][0][0][0] == "routed_away"


def test_many_model_names_over_weeks_keep_the_resets_in_order(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """80,000 model names (one per junk request) and 25 days in one chunk: each request's prefix left its pod by
    a cache reset, and the answer says so (before, the overflowed keys lost the resets)."""
    sc = 72
    prompt = tokens(sc, N * B)
    names = chain_hashes(prompt, B)
    t_a, t_b = -25 * DAY, 3600.0
    ingest(store, collect([
        frames("zz-pod", 1, t_a - 10, store_event(prompt, names)), frames("zz-pod", 2, t_a - 5, CLEARED),
        frames("aa-pod", 1, t_b - 10, store_event(prompt, names)), frames("aa-pod", 2, t_b - 5, CLEARED)]))
    insert_requests(store, [serving(sc, "zz-pod", t=t_a - 20), serving(sc, "aa-pod", t=t_b - 20),
                            request("A", sc, t_a, "zz-pod", prompt), request("B", sc, t_b, "aa-pod", prompt)])
    base = request("junk", sc, t_b - 2, "aa-pod", prompt)
    junk: list[dict[str, Any]] = [{**base, "request_id": f"junk-{k}", "model": f"m{k:06d}", "tenant_id": f"j{k}"}
                                  for k in range(80_000)]
    for i in range(0, len(junk), 20_000):
        insert_requests(store, junk[i:i + 20_000])
    whole = attribute(store, monkeypatch, 10**6)
    for rid in ("A", "B"):
        assert whole[rid][0][0][:2] == ("evicted", "cache_reset"), whole[rid]
