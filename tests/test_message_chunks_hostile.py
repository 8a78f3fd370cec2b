"""What the message chunks and the one-message keys must not claim (a hostile review of their first version, found
before it landed: "first" in the comments is its answer, "before" the answer without it). The rank
marker a chunk's hash leaves out is a rank, not every number of a leading tag; a message with an image has no chunks
(its image's tokens sit among the text's); a rule line or closing tag that frames any text is no "known" document;
the same one-message prompt again finds its last send (key 3), not the latest with the same instructions (key 19);
a list's own numbers are kept."""
from __future__ import annotations

from typing import Any

import pytest

from gateway.fingerprint import chunk_key
from tests.test_conversation_threads import B, row, u, verdicts
from tests.test_plain_client_turns import assert_store_answers_as_reference

DOCS = {n: " ".join(f"{n} sentence {i}: the {n.lower()} service stores objects with replication factor {i}."
                    for i in range(4)) for n in ("Alpha", "Beta", "Gamma")}
RAG_SYS = {"role": "system", "content": "You are the documentation assistant of Acme Cloud. Answer only from the "
                                        "context; cite documents by id."}
CODE_SYS = {"role": "system", "content": "You are a frontend coding assistant. Answer with a short explanation and "
                                         "a fixed code block."}


def causes(rows: list[dict[str, Any]], rid: str = "r2") -> dict[tuple[str, str], int]:
    return verdicts(*rows)[rid]["causes"]


def reusable(c: dict[tuple[str, str], int]) -> int:
    return sum(t for (k, _), t in c.items() if k in ("routed_away", "evicted", "beyond_horizon"))


# -- F1: chunk_key masks every digit of ANY leading tag line, not only a rank -------------------------------------
def test_chunk_key_masks_non_rank_attributes() -> None:
    """A relevance score, an id, a timestamp, a pixel value: all masked, so chunks with other tokens hash equal."""
    a = '<document id="1" relevance="0.91">\nsame text\n</document>'
    b = '<document id="1" relevance="0.62">\nsame text\n</document>'
    assert chunk_key(a) != chunk_key(b)  # first: both '<document id="#" relevance="#.##">...'


def scored(q: str, scores: list[str]) -> str:
    return ("<documents>\n" + "\n".join(f'<document id="{i + 1}" relevance="{s}">\n{DOCS[n]}\n</document>'
                                        for i, (n, s) in enumerate(zip(DOCS, scores, strict=True)))
            + f"\n</documents>\n\n{q}")


def test_same_documents_with_other_scores_are_not_shared() -> None:
    """Same documents, another question: the retriever's scores differ in the first document's tag line, so nothing
    past the header can hit. first: evicted 304 of 315 (every document claimed shared); before: evicted 16."""
    rows = [row("r1", [RAG_SYS, u(scored("How is Beta replicated?", ["0.91", "0.84", "0.77"]))], at=0),
            row("r2", [RAG_SYS, u(scored("What about Gamma, then?", ["0.62", "0.88", "0.93"]))], at=5, cached=0)]
    assert reusable(causes(rows)) <= 32, causes(rows)


def html(px: int) -> str:
    return ("The two cards are not aligned, the second one sits lower than the first. What is wrong with my markup?"
            f'\n\n```html\n<div class="row" style="display: flex; gap: {px}px">\n'
            '  <div class="card">Plan: Starter, 10 seats, monthly billing, no support SLA</div>\n'
            '  <div class="card">Plan: Business, 50 seats, yearly billing, 24/7 support SLA</div>\n'
            "</div>\n```")


def test_an_edited_number_in_a_pasted_tag_is_no_shared_chunk() -> None:
    """The user edits gap: 12px to 16px and sends again (same history: fingerprint predecessor). first version:
    routed_away 112 of 118; before: routed_away 48 (up to the edited line)."""
    rows = [row("r1", [CODE_SYS, u(html(12))], at=0), row("r2", [CODE_SYS, u(html(16))], at=5, pod="pod-b")]
    assert reusable(causes(rows)) <= 48, causes(rows)


def test_an_edited_number_without_system_prompt_via_key_19() -> None:
    """The same without a system prompt: key 19 finds r1, then the masked tag claims everything. first: evicted
    80 of 91; before: no predecessor, unavoidable 91. Right: the question and the fence (~28 tokens) at most."""
    rows = [row("r1", [u(html(12))], at=0), row("r2", [u(html(16))], at=5)]
    assert reusable(causes(rows)) <= 32, causes(rows)


def alert(i: int, ts: str) -> str:
    return (f'<alert id="{i}" fired_at="{ts}">\nHighCPU on web-3: cpu usage above 90 percent for 5 minutes on all '
            "cores of the instance, load average 14.2, top process java (pid 3121) using 380 percent cpu.\n</alert>"
            "\n\nWhat should I check first?")


def test_a_recurring_alert_with_another_id_shares_nothing_past_its_first_line() -> None:
    """A triage bot, no system prompt: the same alert fires again with another id and time. first: routed_away 64
    of 67 (key 19 + masked tag); before: unavoidable 67 (right: the id is in the first block)."""
    rows = [row("r1", [u(alert(93812, "2026-12-07T10:00:00Z"))], at=0),
            row("r2", [u(alert(93907, "2026-12-07T10:15:00Z"))], at=5, pod="pod-b")]
    assert reusable(causes(rows)) == 0, causes(rows)


# -- F2: key 19 on user-only image prompts: the chunks see the text only ------------------------------------------
INSTR = ("Describe this product photo for an online shop listing: name the object, its color, material and "
         "condition, in two sentences, without marketing language.")


def image_first(url: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": INSTR}]}


def image_last(url: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": INSTR},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def with_image_tokens(r: dict[str, Any], n: int = 800) -> dict[str, Any]:
    return {**r, "prompt_tokens": r["prompt_tokens"] + n}  # vLLM's prompt_tokens count the image's tokens


def test_another_image_before_the_same_instruction_shares_nothing() -> None:
    """A captioning batch, image first: no token is shared. first: routed_away 32 (key 19 found r1); before: 0."""
    rows = [row("r1", [image_first("https://cdn.example/1.jpg")], at=0),
            row("r2", [image_first("https://cdn.example/2.jpg")], at=5, pod="pod-b")]
    assert reusable(causes(rows)) == 0, causes(rows)


def test_another_image_after_the_same_instruction_shares_the_instruction_only() -> None:
    """Text first, then an 800-token image: at most the instruction (~40 tokens) is shared. first: routed_away 832
    of 844 (every chunk equal, so the whole prompt, image included); before: no predecessor."""
    rows = [with_image_tokens(row("r1", [image_last("https://cdn.example/1.jpg")], at=0)),
            with_image_tokens(row("r2", [image_last("https://cdn.example/2.jpg")], at=5, pod="pod-b"))]
    assert reusable(causes(rows)) <= 48, causes(rows)


# -- F4: a rule line is a chunk of its own, "known" in any message that has one --------------------------------------
def email(reply: str, sender: str, subject: str, body: str) -> str:
    return (f"Please summarize this email thread for me.\n\n{reply}\n\n________________________________\n"
            f"From: {sender}\nSent: Monday\nSubject: {subject}\n\n{body}")


def test_two_unrelated_email_threads_are_no_rag_drift() -> None:
    """Two users' threads share only the instruction and Outlook's separator line. first: prefix_drift/rag_changed
    16 (the short reply and the separator 'known'); before: routed_away 16, unavoidable 61."""
    rows = [row("r1", [RAG_SYS, u(email("Thanks, that works for us. Let's go with Thursday.", "Dana", "Meeting",
                                        "Could we meet Thursday or Friday afternoon to review the budget?"))], at=0),
            row("r2", [RAG_SYS, u(email("Great, see you then.", "Lee", "Lunch",
                                        "Are you free for lunch on Wednesday near the office?"))], at=5, pod="pod-b")]
    assert not any(k == "prefix_drift" for k, _ in causes(rows)), causes(rows)


# -- F5: key 19 takes the latest request with the same head, not the same prompt --------------------------------------
def test_the_same_prompt_again_behind_another_ticket() -> None:
    """r3 repeats r1 on r1's pod (nothing cached): r1 held all of it. first: predecessor r2 (another ticket),
    routed_away 32 + unavoidable 24; the docs say key 19 finds "the same prompt sent again"."""
    head = ("Classify the support ticket below into exactly one of: billing, outage, account, other. "
            "Answer with the label only.\n\n")
    t1 = head + "Ticket: the dashboard has returned 502 errors since noon for every user of our team."
    t2 = head + "Ticket: I was charged twice in November for the same annual plan renewal, please refund."
    rows = [row("r1", [u(t1)], at=0), row("r2", [u(t2)], at=3, pod="pod-b"), row("r3", [u(t1)], at=5)]
    p = rows[2]["prompt_tokens"]
    assert causes(rows, "r3").get(("evicted", ""), 0) == (p - 1) // B * B, causes(rows, "r3")


# -- F6: rank masking makes numbered lists in ordinary user messages "documents" -----------------------------------
STEPS = ["Install the package with pip and check that the printed version matches the documentation.",
         "Run the database migrations against staging before deploying anything to production.",
         "Restart the worker pool and watch the queue length on the dashboard for ten minutes.",
         "Announce the deploy in the team channel with a link to the changelog entry."]
WRITER = {"role": "system", "content": "You are a helpful writing and coding assistant for the Acme engineering team."}


def checklist(items: list[str], q: str = "Turn these steps into a shell script.") -> str:
    return "Here is our deploy checklist:\n\n" + "\n\n".join(f"{i + 1}. {s}" for i, s in enumerate(items)) + f"\n\n{q}"


def test_another_users_checklist_sharing_one_step_is_no_rag_drift() -> None:
    """Another user's checklist (same system prompt: fingerprint predecessor) repeats one step at another rank.
    first: prefix_drift/rag_changed 64 ("3." and "2." masked alike); before: unavoidable."""
    other = ["Tag the release in git and push the tag to the origin remote so CI builds it.", STEPS[2]]
    rows = [row("r1", [WRITER, u(checklist(STEPS))], at=0),
            row("r2", [WRITER, u(checklist(other, "Is this complete?"))], at=5, pod="pod-b")]
    assert not any(k == "prefix_drift" for k, _ in causes(rows)), causes(rows)


# -- the store job on the same kinds (and a classifier's fixed instructions around each ticket, the same again under
# -- another salt, beyond the horizon, conversation ids on first turns without a system prompt) --------------------
RULES = ("Classify the support ticket below into exactly one of: billing, outage, account, other. Answer with the "
         "label only. " + "Rule: a ticket that mentions an invoice or a refund is billing. " * 3)
TAIL = ("Respond with a JSON object with the keys label and confidence (a number between 0 and 1), nothing else: "
        "no explanation, no markdown, no code fence, no trailing text, and never more than one label per ticket.")


def sandwich(t: str) -> str:
    return f"{RULES}\n\nTicket: {t}\n\n{TAIL}\n\nJSON:"


def mixed_traffic() -> list[dict[str, Any]]:
    t1 = "the dashboard has returned 502 errors since noon for every user."
    t2 = "I was charged twice in November for the same annual plan renewal."
    rows = [
        row("a1", [u(sandwich(t1))], at=0, tenant="a"),
        row("a2", [u(sandwich(t2))], at=5, pod="pod-b", tenant="a"),
        row("a3", [u(sandwich(t1))], at=9, pod="pod-b", tenant="a", cache_salt="s1"),
        row("h1", [CODE_SYS, u(html(12))], at=0, tenant="h"),
        row("h2", [CODE_SYS, u(html(16))], at=5, pod="pod-b", tenant="h"),
        row("h3", [u(html(12))], at=6, tenant="h"),
        row("h4", [u(html(16))], at=8, tenant="h"),
        row("i1", [image_first("https://cdn.example/1.jpg")], at=0, tenant="i"),
        row("i2", [image_first("https://cdn.example/2.jpg")], at=5, pod="pod-b", tenant="i"),
        # key 19 beyond the horizon (an hour): the same instructions two hours later, another in between
        row("z1", [u(sandwich(t1))], at=0, tenant="z"),
        row("z2", [u(sandwich(t2))], at=7200, pod="pod-b", tenant="z"),
        row("z3", [u(sandwich(t1))], at=7300, pod="pod-a", tenant="z"),
        # conversation ids, first turns without a system prompt
        row("c1", [u(sandwich(t1))], at=0, tenant="c", conv="conv-1"),
        row("c2", [u(sandwich(t2))], at=3, tenant="c", conv="conv-2", pod="pod-b"),
        row("c3", [u(sandwich(t2))], at=4, tenant="c", conv="conv-1", pod="pod-b"),
    ]
    rows += [
        row("s1", [RAG_SYS, u(scored("How is Beta replicated?", ["0.91", "0.84", "0.77"]))], at=0, tenant="s"),
        row("s2", [RAG_SYS, u(scored("What about Gamma, then?", ["0.62", "0.88", "0.93"]))], at=5, tenant="s"),
        row("l1", [u(alert(93812, "2026-12-07T10:00:00Z"))], at=0, tenant="l"),
        row("l2", [u(alert(93907, "2026-12-07T10:15:00Z"))], at=5, pod="pod-b", tenant="l"),
        row("e1", [RAG_SYS, u(email("Thanks, that works for us. Let's go with Thursday.", "Dana", "Meeting",
                                    "Could we meet Thursday or Friday afternoon to review the budget?"))], at=0,
                tenant="e"),
        row("e2", [RAG_SYS, u(email("Great, see you then.", "Lee", "Lunch",
                                    "Are you free for lunch on Wednesday near the office?"))], at=5, pod="pod-b",
                tenant="e"),
    ]
    return rows


@pytest.mark.parametrize("runs", [1, 2])
def test_the_store_job_answers_as_the_reference(store, runs):  # type: ignore[no-untyped-def]
    assert_store_answers_as_reference(store, sorted(mixed_traffic(), key=lambda r: r["ts"]), runs)
