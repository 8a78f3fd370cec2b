"""A drift the segment hashes claim is bounded by the block chains (ingest/attribution.py ``chain_shared`` and
``chain_bounded``; column-wise ``attribution_batch.chain_columns``; the store job's ``_chain_pairs``). Found on real
vLLM pods by a hostile hunt: the gateway hashes message fields the chat template does not print (a message's
``name``, a tool call's id, ``content: null`` against ``""``, a document's score), so a turn whose tokens repeat its
previous turn's read ``prefix_drift`` (800 of 1,051 tokens ``history_changed`` where ``routed_away`` was right); and a
one-line system prompt whose timestamp sits at its end drifted from its first token (``volatile_system`` 480 where
448 of it was ``routed_away``). The chains (one hash per full block of the token ids vLLM prefilled, each over its
parent's) prove how far two prompts are equal, whatever the template printed.

Every row is fingerprinted from a real chat body by the reference gateway (tests/test_conversation_threads.py
``row``); its chain is ``kvscope.block_hash.chain_hashes`` of made-up token ids standing for what the template
rendered: the same ids where the template prints the same tokens. Judged by the reference and by the store job."""

from __future__ import annotations

from typing import Any

import pytest

from kvscope.block_hash import chain_hashes
from tests.test_conversation_threads import A1, SYS, U1, U2, B, full, row, store_causes, u, verdicts


def chained(r: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """``r`` with the chain of ``ids`` (one per prompt token) as the gateway logs it at block size B."""
    assert len(ids) == r["prompt_tokens"]
    return {**r, "prompt_block_hashes": chain_hashes(ids, B), "prompt_block_size": B}


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def template_invisible_name() -> list[dict[str, Any]]:
    """t1 on pod-a; t2 on pod-b re-sends t1's user message with a ``name`` the template does not print (its tokens
    repeat t1's), then the reply and a new message. pod-b never saw t1: cached 0."""
    t1 = row("t1", [SYS, U1], at=0, conv="c-name", pod="pod-a")
    t2 = row("t2", [SYS, {**U1, "name": "alice"}, A1, U2], at=30, conv="c-name", pod="pod-b", cached=0)
    first = ids(t1["prompt_tokens"])
    return [chained(t1, first), chained(t2, first + ids(t2["prompt_tokens"] - len(first), 50_000))]


def one_line_timestamp() -> list[dict[str, Any]]:
    """Two requests of one tenant whose one-line system prompt ends in the time of the request; r2 on the other pod.
    Their tokens are equal up to the timestamp, 8 tokens before the system prompt's end."""
    text = "You are the support bot for Acme. " + " ".join(f"Policy {i}: refunds take {i} days." for i in range(30))
    r1 = row("r1", [{"role": "system", "content": text + " Current time: 2026-12-07 02:11:05."}, u("Refund?")],
             at=0, pod="pod-a")
    r2 = row("r2", [{"role": "system", "content": text + " Current time: 2026-12-07 02:14:41."}, u("Refund?")],
             at=30, pod="pod-b", cached=0)
    at = r1["system_tokens"] - 8
    return [chained(r1, ids(r1["prompt_tokens"])),
            chained(r2, ids(at) + ids(r2["prompt_tokens"] - at, 70_000))]


def without_chains(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "prompt_block_hashes": [], "prompt_block_size": 0} for r in rows]


def test_a_field_the_template_does_not_print_is_no_drift() -> None:
    t1, t2 = template_invisible_name()
    before = verdicts(*without_chains([t1, t2]))["t2"]  # the segments alone read a drift
    assert any(c == "prefix_drift" for c, _ in before["causes"]), before
    got = verdicts(t1, t2)["t2"]
    assert got["pred"] == "t1"
    assert got["causes"] == {("routed_away", ""): full(t1["prompt_tokens"]),
                             ("unavoidable", ""): t2["prompt_tokens"] - full(t1["prompt_tokens"])}, got


def test_a_drift_starts_at_the_first_block_the_chains_differ() -> None:
    r1, r2 = one_line_timestamp()
    before = verdicts(*without_chains([r1, r2]))["r2"]
    assert before["causes"].get(("prefix_drift", "volatile_system"), 0) > 0 and ("routed_away", "") not in \
        before["causes"], before
    got = verdicts(r1, r2)["r2"]
    equal = (r1["system_tokens"] - 8) // B * B  # the blocks before the one holding the timestamp
    assert got["pred"] == "r1"
    assert got["causes"][("routed_away", "")] == equal, got
    assert got["causes"][("prefix_drift", "volatile_system")] > 0, got
    assert set(got["causes"]) == {("routed_away", ""), ("prefix_drift", "volatile_system"), ("unavoidable", "")}
    assert sum(got["causes"].values()) == r2["prompt_tokens"]


def test_chains_that_differ_before_the_drift_change_nothing() -> None:
    """A chain that proves less than the segments (it differs from the first block) leaves their verdict; so does a
    chain at another block size, and a predecessor without one."""
    r1, r2 = one_line_timestamp()
    plain = verdicts(*without_chains([r1, r2]))["r2"]
    early = {**r2, "prompt_block_hashes": chain_hashes(ids(r2["prompt_tokens"], 90_000), B)}
    assert verdicts(r1, early)["r2"] == plain
    other_size = {**r2, "prompt_block_hashes": chain_hashes(ids(r2["prompt_tokens"]), 2 * B),
                  "prompt_block_size": 2 * B}
    assert verdicts({**r1, "prompt_block_hashes": chain_hashes(ids(r1["prompt_tokens"]), B)}, other_size)["r2"] \
        == plain
    assert verdicts(without_chains([r1])[0], r2)["r2"] == plain


@pytest.mark.parametrize("traffic", [template_invisible_name, one_line_timestamp])
def test_the_store_job_bounds_the_drift_the_same_way(store, traffic) -> None:  # type: ignore[no-untyped-def]
    rows = traffic()
    target = rows[-1]["request_id"]
    expected = verdicts(*rows)[target]["causes"]
    assert store_causes(store, rows)[target] == expected


def test_documents_sent_as_parts_and_reordered_are_rag_reordered(store) -> None:  # type: ignore[no-untyped-def]
    """Each retrieved document its own text part (gateway.fingerprint.message_chunks): the same documents in another
    order on the same pod read `prefix_drift / rag_reordered` after the first document, not `unavoidable` (found on
    real pods by a hostile hunt), in the reference and the store job alike (no chains logged here)."""
    docs = [f"Document {k}: " + " ".join(f"Scroll {k}.{i} lies in vault {i % 5} of the archive." for i in range(12))
            for k in range(3)]

    def ask(order: list[int], q: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": docs[k]} for k in order]
                + [{"type": "text", "text": q}]}

    r1 = row("r1", [SYS, ask([0, 1, 2], "Which scroll is in vault 3?")], at=0, pod="pod-a")
    first = full(r1["system_tokens"] + r1["suffix_chunk_tokens"][0])
    r2 = row("r2", [SYS, ask([0, 2, 1], "Which scroll is in vault 4?")], at=5, pod="pod-a", cached=first)
    got = verdicts(r1, r2)["r2"]
    assert got["pred"] == "r1" and got["causes"].get(("prefix_drift", "rag_reordered"), 0) > 0, got
    assert store_causes(store, [r1, r2])["r2"] == got["causes"]


def test_chain_columns_count_the_leading_run_as_the_reference_does() -> None:
    """ingest.attribution_batch.chain_columns against ingest.attribution.chain_shared, on chains that agree again
    after a differing block (found by a review: the column-wise count took every equal position), chains of other
    lengths, block sizes, and missing ones."""
    import polars as pl

    from ingest.attribution import chain_shared
    from ingest.attribution_batch import CHAIN_COVERS, CHAIN_SHARED, chain_columns

    cases = [([1, 9, 3, 4], 16, [1, 2, 3, 4], 16), ([1, 2, 3], 16, [1, 2], 16), ([1, 2], 16, [1, 2, 3], 16),
             ([1, 2], 16, [1, 2], 32), ([], 0, [1], 16), ([5], 16, [], 0), ([7, 8], 16, [1, 8], 16)]
    df = pl.DataFrame({"prompt_block_hashes": [c[0] for c in cases], "prompt_block_size": [c[1] for c in cases],
                       "p_prompt_block_hashes": [c[2] for c in cases], "p_prompt_block_size": [c[3] for c in cases]},
                      schema_overrides={"prompt_block_hashes": pl.List(pl.UInt64),
                                        "p_prompt_block_hashes": pl.List(pl.UInt64)})
    got = chain_columns(df).select(CHAIN_SHARED, CHAIN_COVERS).rows()
    expected = [chain_shared(*c) or (-1, False) for c in cases]
    assert got == expected
    assert expected[:3] == [(16, False), (32, True), (32, False)]
