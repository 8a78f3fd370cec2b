"""Prompts with nothing before the final user message (no system prompt, tools, documents or history): a script, an
eval harness, a batch classifier that sends its instructions in the one user message. Found by a hostile review:
such a request had no predecessor key at all (its fingerprint covers the empty stable prefix), so the same prompt
again on another pod, or the same instructions with another ticket, read every token ``unavoidable`` where
another request had held them. Key 19 (``attribution.KEY_MESSAGE_HEAD``, sql/migrations/0047) is the message's first
content-defined chunk. Every row is fingerprinted from a real chat body by the reference gateway and judged by the
reference and by the store job."""

from __future__ import annotations

from typing import Any

import pytest

from ingest import attribution
from tests.test_conversation_threads import B, row, u, verdicts
from tests.test_plain_client_turns import assert_store_answers_as_reference

RULES = ("Classify the support ticket below into exactly one of: billing, outage, account, other. Answer with the "
         "label only. " + "Rule: a ticket that mentions an invoice or a refund is billing. " * 8)
TICKET1, TICKET2 = "Ticket: the dashboard returns 502 since noon.", "Ticket: I was charged twice in November."


def causes(rows: list[dict[str, Any]], rid: str = "r2") -> dict[tuple[str, str], int]:
    return verdicts(*rows)[rid]["causes"]


@pytest.mark.parametrize(("pod", "cause"), [("pod-b", "routed_away"), ("pod-a", "evicted")])
def test_the_same_prompt_again_is_reusable(pod: str, cause: str) -> None:
    """The same one-message prompt, 5 s later, with nothing cached: all its full blocks but the last token's."""
    msg = [u(f"{RULES}\n\n{TICKET1}")]
    rows = [row("r1", msg, at=0), row("r2", msg, at=5, pod=pod, cached=0)]
    p = rows[1]["prompt_tokens"]
    assert causes(rows) == {(cause, ""): (p - 1) // B * B, ("unavoidable", ""): p - (p - 1) // B * B}
    assert verdicts(*rows)["r2"]["pred"] == "r1"


def test_the_same_instructions_with_another_ticket_share_their_blocks() -> None:
    """The instructions (the message's first chunk) were r1's; the ticket is new. Before: all unavoidable."""
    rows = [row("r1", [u(f"{RULES}\n\n{TICKET1}")], at=0), row("r2", [u(f"{RULES}\n\n{TICKET2}")], at=5,
                                                              pod="pod-b", cached=0)]
    got = causes(rows)
    head = rows[1]["suffix_chunk_tokens"][0]
    assert got[("routed_away", "")] >= head - B and set(got) == {("routed_away", ""), ("unavoidable", "")}, got


def test_a_hit_on_the_shared_instructions_leaves_only_the_ticket() -> None:
    """Same pod, the instructions' blocks hit: nothing avoidable missed."""
    rows = [row("r1", [u(f"{RULES}\n\n{TICKET1}")], at=0),
            row("r2", [u(f"{RULES}\n\n{TICKET2}")], at=5, cached=None)]
    rows[1]["cached_tokens"] = (rows[1]["suffix_chunk_tokens"][0] + 4) // B * B
    assert set(causes(rows)) == {("unavoidable", "")}


@pytest.mark.parametrize("second", [
    [u("Hi!\n\nmy invoice for November shows a charge twice, can you check it and refund one of them please?")],
    [{"role": "system", "content": "Be brief."}, u(f"{RULES}\n\n{TICKET1}")],
], ids=["short first chunk", "a system prompt"])
def test_no_key_for_a_short_head_and_none_across_a_stable_prefix(second: list[dict[str, Any]]) -> None:
    """Negative controls: a first chunk under a block ("Hi!", a sentence of its own) is no key; a request with a
    system prompt finds its predecessors by that prompt, not by its message's first chunk."""
    first = [u("Hi!\n\nthe dashboard returns 502 since noon for every user of our team, can you look at it?")]
    rows = [row("r1", first, at=0), row("r2", second, at=5, pod="pod-b", cached=0),
            row("r3", [u(f"{RULES}\n\n{TICKET2}")], at=6, pod="pod-b", cached=0)]
    assert verdicts(*rows)["r2"]["pred"] == ""
    assert attribution.KEY_MESSAGE_HEAD not in {k for k, _ in attribution.predecessor_keys(rows[1])}
    assert verdicts(*rows)["r3"]["pred"] == "", "r2's message head is no key: it has a system prompt"


def test_another_cache_salt_is_no_predecessor() -> None:
    msg = [u(f"{RULES}\n\n{TICKET1}")]
    rows = [row("r1", msg, at=0, cache_salt="user-1"), row("r2", msg, at=5, pod="pod-b", cached=0,
                                                          cache_salt="user-2")]
    assert verdicts(*rows)["r2"]["pred"] == ""


def traffic() -> list[dict[str, Any]]:
    same = [u(f"{RULES}\n\n{TICKET1}")]
    return [row("r1", same, at=0), row("r2", same, at=5, pod="pod-b", cached=0),
            row("r3", [u(f"{RULES}\n\n{TICKET2}")], at=9, pod="pod-a", cached=0),
            row("s1", [u("Hi!\n\nthe dashboard returns 502 since noon for every user of our team, look at it?")],
                at=10, pod="pod-a"),
            row("r4", same, at=12, pod="pod-b", cached=0, cache_salt="user-2")]


@pytest.mark.parametrize("runs", [1, 2])
def test_the_store_job_answers_as_the_reference(store, runs):  # type: ignore[no-untyped-def]
    preds = assert_store_answers_as_reference(store, traffic(), runs)
    assert preds["r2"] == "r1" and preds["r3"] == "r2" and preds["r4"] == ""
