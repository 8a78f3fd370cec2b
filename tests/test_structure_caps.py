"""The caps on the prompt's structure (gateway/fingerprint.py ``MAX_SUFFIX_CHUNKS``, ``MAX_SYSTEM_LINES``) must not
hide what they cap (found by a review). A final message of more than 63 paragraphs (a pasted contract, a paper, a
log, then the question) had its 64th chunk hold the rest of the document and the question, so that chunk always
differed: the same document asked again with another question read the document from paragraph 64 on `unavoidable`.
A system prompt of more than 256 lines (a coding agent's rules, then an environment block) had its 256th entry hold
every line from there on, so a volatile line anywhere past line 255 was placed at line 256: the unchanged lines
between read as drift. Now the final chunk stays its own, and a long system prompt's lines are grouped evenly
(2 lines an entry up to 512 lines, 4 up to 1,024, ...). Every row is fingerprinted from a real chat body by the
reference gateway and judged by the reference and by the store job."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.fingerprint import TokenCounter
from tests.test_conversation_threads import B, full, row, u, verdicts
from tests.test_plain_client_turns import assert_store_answers_as_reference

EST = TokenCounter()
SYS = {"role": "system", "content": "You are a contracts assistant. Answer from the document the user pasted; quote "
                                    "the clause you rely on."}
DOC = "\n\n".join(f"Clause {i}. The supplier shall deliver the goods of lot {i} within {i + 3} business days of the "
                  f"order; a delay gives the buyer a credit of {i % 7 + 1}% of the lot's price per day."
                  for i in range(160))


def pasted(question: str) -> dict[str, str]:
    return u(f"{DOC}\n\n{question}")


QUESTIONS = ["What is the credit for a late lot 12?", "Which lots have the longest delivery time?"]
FIELDS = [f"Extract {field}; answer null when absent." for field in
          ("the supplier's name", "the longest delivery time", "the highest daily credit", "the governing law")]


def document_asked_again() -> list[dict[str, Any]]:
    """One document of 160 clauses, a question after it; another user pastes it with another question, pod-b."""
    return [row("r1", [SYS, pasted(QUESTIONS[0])], at=0, pod="pod-a"),
            row("r2", [SYS, pasted(QUESTIONS[1])], at=5, pod="pod-b", cached=0)]


def per_field_extraction() -> list[dict[str, Any]]:
    """One document, one request per field to extract (a pipeline fanning out), on alternate pods, nothing cached:
    each later request finds the latest earlier one, which held the whole document."""
    return [row(f"f{i}", [SYS, pasted(field)], at=i, pod="pod-a" if i % 2 == 0 else "pod-b", cached=0)
            for i, field in enumerate(FIELDS)]


def before_question(r: dict[str, Any], question: str) -> int:
    """Prompt tokens of ``r`` before ``question`` (its final paragraph, ceil(characters / 4) tokens; the prompt's
    last token is the template's): everything it shares with the same document asked another question."""
    return r["prompt_tokens"] - EST.count(question) - 1


def test_a_long_document_asked_again_with_another_question_is_shared() -> None:
    """Before: routed_away 2608 + unavoidable 4037 (the 64th chunk held paragraphs 63 .. 159 and the question);
    now every full block before the question is routed_away, and only the question is new."""
    rows = document_asked_again()
    assert len(rows[1]["suffix_chunk_hashes"]) == 64
    v = verdicts(*rows)["r2"]
    assert v["pred"] == "r1"
    assert v["causes"][("routed_away", "")] >= full(before_question(rows[1], QUESTIONS[1])) - B, v
    assert v["causes"].get(("unavoidable", ""), 0) <= EST.count(QUESTIONS[1]) + 2 * B, v
    assert set(v["causes"]) == {("routed_away", ""), ("unavoidable", "")}, v


def test_each_field_request_finds_the_document_shared() -> None:
    """Before: each later request read routed_away 2608 + unavoidable ~4040 (61% of its prompt)."""
    rows = per_field_extraction()
    got = verdicts(*rows)
    for r, field in zip(rows[1:], FIELDS[1:], strict=True):
        v = got[r["request_id"]]
        assert v["causes"].get(("routed_away", ""), 0) >= full(before_question(r, field)) - B, (r["request_id"], v)
        assert v["causes"].get(("unavoidable", ""), 0) <= EST.count(field) + 2 * B, (r["request_id"], v)


RULES = [f"- Rule {i}: when editing files of kind {i % 9}, keep the existing style and run the linter."
         for i in range(396)]


def agent_system(user: str, branch: str, trace: str = "7f3a91c2e0b4", trace_at: int | None = None) -> dict[str, str]:
    """A coding agent's system prompt of 400 lines: 396 rules (line ``trace_at`` a session trace the masks do not
    know, when given), then an environment block (cwd, branch, platform, date) of the session."""
    rules = list(RULES)
    if trace_at is not None:
        rules[trace_at] = f"Session trace: {trace}"
    env = [f"Working directory: /home/{user}/src/shop", f"Git branch: {branch}", "Platform: linux",
           f"Today's date: 2026-12-07 (session of {user})"]
    return {"role": "system", "content": "\n".join(rules + env)}


def environment_block_differs() -> list[dict[str, Any]]:
    """Two users' sessions 5 s apart, the second on pod-b: their prompts differ in the environment block alone."""
    return [row("a1", [agent_system("alice", "main"), u("Fix the failing test in cart.py")], at=0, pod="pod-a"),
            row("b1", [agent_system("bob", "feature/tax"), u("Add VAT to the invoice total")], at=5, pod="pod-b",
                cached=0)]


def trace_line_differs() -> list[dict[str, Any]]:
    """The same session's system prompt, resent 5 s later on pod-b with another trace at line 301 (of 400)."""
    return [row("s1", [agent_system("alice", "main", "7f3a91c2e0b4", 301), u("Fix the failing test in cart.py")],
                at=0, pod="pod-a"),
            row("s2", [agent_system("alice", "main", "0b4e2c19a37f", 301), u("Fix the failing test in cart.py")],
                at=5, pod="pod-b", cached=0)]


def test_an_environment_block_past_the_cap_drifts_at_its_own_lines() -> None:
    """Before: routed_away 5504 + volatile_system 3008 (the drift placed at line 256, 145 unchanged lines read as
    drift); now every line before the block is routed_away."""
    rows = environment_block_differs()
    v = verdicts(*rows)["b1"]
    assert v["pred"] == "a1"
    shared = sum(len(r) + 1 for r in RULES) // 4 + 4  # the rules and the system message's template tokens
    assert v["causes"][("routed_away", "")] >= full(shared) - B, v
    assert ("prefix_drift", "system_changed") not in v["causes"], v


def test_a_volatile_line_past_the_cap_is_placed_where_it_sits() -> None:
    """One line of 400 differs (a trace id the masks do not know): the lines confirm one prompt (volatile_system),
    and the drift starts at that line's group (lines 300 and 301), not at line 256: every full block before it is
    routed_away, the drift is the rest of the system prompt. Before: routed_away 5504 + volatile_system 3008."""
    rows = trace_line_differs()
    v = verdicts(*rows)["s2"]
    assert v["pred"] == "s1"
    before = sum(len(r) + 1 for r in RULES[:300]) // 4 + 4
    # each entry's tokens are ceil(characters / 4) (the estimate counter): their sum runs a little past the text's
    assert full(before) - B <= v["causes"][("routed_away", "")] <= full(before) + 2 * B, v
    drift = v["causes"][("prefix_drift", "volatile_system")]
    assert abs(drift - (rows[1]["system_tokens"] + 4 - before)) <= 2 * B, v
    assert set(v["causes"]) == {("routed_away", ""), ("prefix_drift", "volatile_system"), ("unavoidable", "")}, v


@pytest.mark.parametrize("traffic", [document_asked_again, per_field_extraction, environment_block_differs,
                                     trace_line_differs])
@pytest.mark.parametrize("runs", [1, 2])
def test_store_job_answers_as_the_reference(store, traffic, runs):  # type: ignore[no-untyped-def]
    assert_store_answers_as_reference(store, traffic(), runs)
