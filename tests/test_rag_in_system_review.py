"""Documents in the system prompt, reviewed: traffic shapes where the first version of the rule
(tests/test_rag_in_system.py; ingest/attribution.py ``system_document_drift``, ``head_only``, key 20) read a volatile
block, a memory summary, a user profile or another app's instructions as replaced documents (``rag_changed``), or
called a predecessor's own documents new content (``unavoidable``) when the rule could not read them. The rule now
needs a document the predecessor had to have moved (paragraphs replaced in place are the line rules'), and the head
alone counts only when no line after it was the predecessor's. Built as in tests/test_rag_in_system.py (reference
gateway rows, estimated tokens, block 16); the store job answers as the reference on every shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.test_conversation_threads import asst, row, u, verdicts
from tests.test_plain_client_turns import assert_store_answers_as_reference
from tests.test_rag_in_system import ABCD, DOCS, HEAD, Q1, Q2

TONE = ("Tone: be friendly but professional. Avoid slang, emojis and exclamation marks. Address the customer by name "
        "when the name is known, and never speculate about internal roadmaps or unreleased features.")
PRIVACY = ("Privacy: never repeat a customer's full card number, password or security answers, even if the customer "
           "typed them. Mask all but the last four digits of any card or account number you quote back.")
FORMAT = ("Format: answer in at most five sentences. Use bullet points for lists of steps. Put commands and file paths "
          "in code spans, and end with a one-line summary when the answer has more than three steps.")


def sysm(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def pair(before: str, after: str, **kw: Any) -> list[dict[str, Any]]:
    """r1 on pod-a, r2 (another question) on pod-b with nothing cached, no ids unless given."""
    return [row("r1", [sysm(before), u(Q1)], at=0, **kw), row("r2", [sysm(after), u(Q2)], at=5, pod="pod-b", **kw)]


def causes(rows: list[dict[str, Any]], rid: str = "r2") -> dict[tuple[str, str], int]:
    return verdicts(*rows)[rid]["causes"]


def drift(got: dict[tuple[str, str], int]) -> int:
    return sum(v for (c, _), v in got.items() if c == "prefix_drift")


# -- 1. a session paragraph of two short id lines (each under 16 tokens) -----------------------------------------
def session(x: str, y: str) -> str:
    return (f"Session {x} for account acct-{y} on shard eu-{y[:3]}\n"
            f"Trace {y}-{x} opened by edge node fra-{x[:4]}")


def session_pair() -> list[dict[str, Any]]:
    docs = [DOCS[n] for n in ABCD]
    return pair("\n\n".join([HEAD, session("7f3a91c2e0b4", "91ab22cd"), *docs]),
                "\n\n".join([HEAD, session("b00b1e5c0de9", "d34db33f"), *docs]))


def test_a_two_line_session_paragraph_with_the_same_documents_stays_volatile_system() -> None:
    """Only the two id lines changed; the four documents are r1's, in r1's order: volatile_system 352 (the line
    rule, 2 lines of 11), as before key 20. The first version read rag_changed 352 (documents replaced, for identical
    documents): nothing the predecessor had moved."""
    assert causes(session_pair()) == {("routed_away", ""): 48, ("prefix_drift", "volatile_system"): 352,
                                      ("unavoidable", ""): 15}


# -- 2. a memory summary of three lines, documents unchanged ---------------------------------------------------
MEM1 = ("Memory summary: the user is Dana, a backend engineer at Initech.\n"
        "Last session: asked about S3 replication lag on 2026-12-01.\n"
        "Open item: wants a runbook for bucket failover.")
MEM2 = ("Memory summary: the user is Dana, a staff engineer at Initech now.\n"
        "Last session: asked about Kafka consumer lag on 2026-12-06.\n"
        "Open item: wants alerts for consumer group rebalances.")


def memory_pair() -> list[dict[str, Any]]:
    docs = [DOCS[n] for n in ABCD]
    return pair("\n\n".join([HEAD, MEM1, *docs]), "\n\n".join([HEAD, MEM2, *docs]))


def test_a_changed_memory_summary_before_the_same_documents_is_no_document_change() -> None:
    """volatile_system 368 (3 lines of 13), as before; the first version read rag_changed 368, though every document
    is r1's in place."""
    assert causes(memory_pair()) == {("routed_away", ""): 48, ("prefix_drift", "volatile_system"): 368,
                                     ("unavoidable", ""): 14}


def memory_conversation() -> list[dict[str, Any]]:
    """No retrieval at all: instruction paragraphs and a memory summary, a conversation with ids."""
    return [row("r1", [sysm("\n\n".join([HEAD, MEM1, TONE, PRIVACY, FORMAT])), u(Q1)], at=0, conv="c"),
            row("r2", [sysm("\n\n".join([HEAD, MEM2, TONE, PRIVACY, FORMAT])), u(Q1), asst("ok"), u(Q2)], at=5,
                conv="c")]


def test_a_memory_summary_in_a_prompt_without_documents_is_not_rag_changed() -> None:
    """system_changed 208, as before; the first version read rag_changed 208 for a prompt without documents."""
    assert causes(memory_conversation()) == {("evicted", "evicted_before_next_turn"): 48,
                                             ("prefix_drift", "system_changed"): 208, ("unavoidable", ""): 27}


# -- 3. a compact JSON user profile (json.dumps, one line of 88 tokens) -----------------------------------------
def profile(name: str, plan: str, sid: str) -> str:
    return "User profile: " + json.dumps({
        "name": name, "email": name.lower().replace(" ", ".") + "@example.com", "plan": plan, "session": sid,
        "company": "Initech GmbH", "role": "backend engineer", "timezone": "Europe/Berlin",
        "preferences": {"language": "en", "units": "metric", "verbosity": "short", "code_style": "python"},
        "recent_products": ["object storage", "kafka", "cdn"]})


def profile_pair() -> list[dict[str, Any]]:
    docs = [DOCS[n] for n in ABCD]
    return pair("\n\n".join([HEAD, profile("Dana Smith", "enterprise", "7f3a91c2e0b4"), *docs]),
                "\n\n".join([HEAD, profile("Lee Wong", "starter", "b00b1e5c0de9"), *docs]))


def test_a_per_user_json_profile_line_before_the_same_documents_stays_volatile_system() -> None:
    """volatile_system 416, as before; the first version read rag_changed 416 (a line of 88 tokens)."""
    rows = profile_pair()
    assert rows[1]["system_line_tokens"][2] == 88
    assert causes(rows) == {("routed_away", ""): 48, ("prefix_drift", "volatile_system"): 416,
                            ("unavoidable", ""): 9}


# -- 4. numbered documents ("Document 1:" on its own line) reordered ---------------------------------------------
def numbered(names: list[str]) -> str:
    return HEAD + "\n\n" + "\n\n".join(f"Document {i + 1}:\n{DOCS[n]}" for i, n in enumerate(names))


def numbered_pair() -> list[dict[str, Any]]:
    return pair(numbered(ABCD), numbered(["Beta", "Alpha", "Delta", "Gamma"]))


def test_numbered_documents_reordered_are_not_new_content() -> None:
    """The same four documents in another order, each under a "Document i:" line. The first version: routed_away
    48, unavoidable 348 (found on the head alone, r1's documents called new content). The title line stays in place,
    so the rule cannot read the paragraphs as documents; the lines after the head are r1's, so the head is not all
    r1 shared: the system prompt's drift from the first changed line (before key 20: cold 384)."""
    assert causes(numbered_pair()) == {("routed_away", ""): 48, ("prefix_drift", "system_changed"): 336,
                                       ("unavoidable", ""): 12}


# -- 5. a multi-line JSON profile, then the same documents --------------------------------------------------------
PROF1 = ('{\n  "name": "Dana Smith",\n  "plan": "enterprise",\n  "region": "eu-west-1",\n'
         '  "last_login": "2026-12-06",\n  "open_tickets": 3\n}')
PROF2 = ('{\n  "name": "Lee Wong",\n  "plan": "starter",\n  "region": "us-east-2",\n'
         '  "last_login": "2026-11-30",\n  "open_tickets": 0\n}')


def pretty_profile_pair() -> list[dict[str, Any]]:
    docs = [DOCS[n] for n in ABCD]
    return pair("\n\n".join([HEAD, "User profile:", PROF1, *docs]), "\n\n".join([HEAD, "User profile:", PROF2, *docs]))


def test_a_pretty_printed_profile_before_the_same_documents_leaves_them_no_new_content() -> None:
    """The first version: routed_away 64, unavoidable 355: r1's four documents, in place, called new content. Now a
    changed system prompt displaced them (before key 20: cold 400)."""
    assert causes(pretty_profile_pair()) == {("routed_away", ""): 64, ("prefix_drift", "system_changed"): 336,
                                             ("unavoidable", ""): 19}


# -- 6. a "Current time" line of its own between the head and reordered documents ---------------------------------
def timed(ts: str, names: list[str], after: bool = False) -> str:
    docs = "\n\n".join(DOCS[n] for n in names)
    return (HEAD + "\n\n" + docs + "\n\nCurrent time: " + ts) if after else \
        (HEAD + "\n\nCurrent time: " + ts + "\n\n" + docs)


def timed_pair(after: bool = False) -> list[dict[str, Any]]:
    return pair(timed("2026-12-07T10:00:00Z", ABCD, after),
                timed("2026-12-07T10:00:05Z", ["Beta", "Alpha", "Delta", "Gamma"], after))


def timed_after_pair() -> list[dict[str, Any]]:
    return timed_pair(after=True)


def test_a_time_line_before_reordered_documents_leaves_them_no_new_content() -> None:
    """r1's four documents reordered behind a per-request time line. The first version: unavoidable 345 (the short
    time line fails the documents' guard, and the head alone was taken). Now a drift over those 336 tokens."""
    assert causes(timed_pair()) == {("routed_away", ""): 48, ("prefix_drift", "system_changed"): 336,
                                    ("unavoidable", ""): 9}


def test_reordered_documents_followed_by_a_changed_time_line_drift_over_the_documents() -> None:
    """The same four documents reordered, then a changed time line at the system prompt's end: the documents drift
    (rag_changed: the sets compared hold the predecessor's time line, which the rule cannot tell from a dropped
    document), the time line and the question new content. Before key 20: cold 384."""
    assert causes(timed_pair(after=True)) == {("routed_away", ""): 48, ("prefix_drift", "rag_changed"): 320,
                                              ("unavoidable", ""): 25}


# -- 7. two apps of one tenant sharing an instruction head, no documents at all -----------------------------------
APP_SUPPORT = ("Role: you handle support tickets for Acme storage products.\n"
               "Triage each question into outage, billing or how-to before answering.\n"
               "For outages, link the status page and never promise an ETA.")
APP_SALES = ("Role: you are the sales assistant for Acme enterprise plans.\n"
             "Qualify the lead by company size, region and current provider.\n"
             "Offer a demo call when the company has more than 200 employees.")


def two_apps() -> list[dict[str, Any]]:
    return pair("\n\n".join([HEAD, APP_SUPPORT, TONE, PRIVACY, FORMAT]),
                "\n\n".join([HEAD, APP_SALES, TONE, PRIVACY, FORMAT]))


def test_another_apps_instructions_under_the_same_head_are_not_rag_changed() -> None:
    """The sales app's request finds the support app's on the shared head (key 20): the head's blocks reusable, the
    changed role paragraph system_changed 208 (before key 20: cold 256; the first version read the role paragraph as
    a replaced document, rag_changed 208, in a prompt without retrieval)."""
    assert causes(two_apps()) == {("routed_away", ""): 48, ("prefix_drift", "system_changed"): 208,
                                  ("unavoidable", ""): 14}


# -- 8. LangChain's legacy stuff prompt ("... Question: {question}\nHelpful Answer:") sent as the system message ----
def legacy(names: list[str], question: str) -> str:
    return HEAD + "\n\n" + "\n\n".join(DOCS[n] for n in names) + "\n\nQuestion: " + question + "\nHelpful Answer:"


def legacy_pair() -> list[dict[str, Any]]:
    return pair(legacy(ABCD, Q1), legacy(["Beta", "Alpha", "Delta", "Gamma"], Q2))


def test_the_legacy_stuff_prompt_with_reordered_documents_drifts_over_the_documents() -> None:
    """The same four documents reordered, then the question lines. The first version: unavoidable 349 (the known
    "Helpful Answer:" line made j the last line, the new short question line failed the guard, the head alone was
    taken). Now the system prompt's drift over the documents; only the question lines and the message are new."""
    assert causes(legacy_pair()) == {("routed_away", ""): 48, ("prefix_drift", "system_changed"): 336,
                                     ("unavoidable", ""): 13}


# -- 9. documents that end with the same source line -------------------------------------------------------------
def sourced(names: list[str]) -> str:
    return HEAD + "\n\n" + "\n\n".join(DOCS[n] + "\nSource: internal wiki" for n in names)


def sourced_pair() -> list[dict[str, Any]]:
    return pair(sourced(ABCD), sourced(["Beta", "Alpha", "Delta", "Gamma"]))


def test_reordered_documents_sharing_a_trailer_line_drift_over_the_documents() -> None:
    """Each document ends with "Source: internal wiki": reordered, that line stays in place, so the rule cannot read
    them as documents. The first version: unavoidable 358; now the system prompt's drift (before key 20: cold)."""
    assert causes(sourced_pair()) == {("routed_away", ""): 48, ("prefix_drift", "system_changed"): 336,
                                      ("unavoidable", ""): 22}


# -- the store job on every shape ------------------------------------------------------------------------------
SHAPES = (session_pair, memory_pair, memory_conversation, profile_pair, numbered_pair, pretty_profile_pair, timed_pair,
          timed_after_pair, two_apps, legacy_pair, sourced_pair)


@pytest.mark.parametrize("runs", [1, 2])
def test_the_store_job_answers_as_the_reference_on_these_shapes(store, runs):  # type: ignore[no-untyped-def]
    rows = [{**r, "request_id": f"{k.__name__}-{r['request_id']}", "tenant_id": k.__name__,
             "conversation_id": (f"{k.__name__}-{r['conversation_id']}" if r["conversation_id"] else "")}
            for k in SHAPES for r in k()]
    assert_store_answers_as_reference(store, rows, runs)
