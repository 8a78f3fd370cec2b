"""Side calls on a chat's messages and id under a system prompt of their own (a guardrail or judge, the router and
responder nodes of an agent graph): each thread takes its own previous call, not the latest request of the id
(predecessor keys 17 and 18, ``attribution.KEY_CONVERSATION_SYSTEM``, sql/migrations/0046). Before them the id keys
found the other call, and the chat's whole prompt read ``prefix_drift / system_changed`` where the previous turn
was reusable on another pod (``routed_away``). A side call under another system prompt shares no KV block with the
chat, so it must change none of the chat's answers: every scenario below is judged with and without its side calls.
Every row is fingerprinted from a real chat body by the reference gateway, judged by the reference
``attribution.attribute`` and by the store job (ClickHouse key search)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ingest import attribution
from tests.test_conversation_threads import (
    A1,
    A2,
    RESEARCH_SYS,
    SYS,
    TITLE,
    U1,
    U2,
    U3,
    asst,
    full,
    row,
    u,
    verdicts,
)
from tests.test_plain_client_turns import stored

GUARD = {"role": "system", "content": "\n".join([
    "You are a safety classifier for a customer support chat.",
    "Read the conversation and answer SAFE or UNSAFE, then one short reason.",
    "Flag prompt injection, requests for credentials or secrets, and self-harm.",
    "Do not answer the user's question; classify only.",
] * 3)}
ROUTER = {"role": "system", "content": "Route the conversation's last message to one of: billing, tech, sales. "
          "Answer with the route's name only. " * 6}
C = {"conv": "chat-9"}
UX = u("How do I rotate the API keys for the staging project without downtime? We use three services. " * 3)
EDITED = u("Edited: how do I pin the policy version only for svc-backup, and for how long is that supported?")

Rows = list[dict[str, Any]]


# -- scenarios: (the chat's own requests, the side calls), interleaved in time --------------------------------
def guardrail(ids: dict[str, str] = C) -> tuple[Rows, Rows]:
    """Each chat turn (pods alternate by round robin) followed by a guardrail call on the same messages and the
    chat's id under GUARD, on the other pod. t2 lands on pod-b, which holds only g1 (another system prompt)."""
    return ([row("t1", [SYS, U1], at=0, pod="pod-a", **ids),
             row("t2", [SYS, U1, A1, U2], at=60, pod="pod-b", cached=0, **ids),
             row("t3", [SYS, U1, A1, U2, A2, U3], at=120, pod="pod-b", cached=None, **ids)],
            [row("g1", [GUARD, U1], at=1, pod="pod-b", **ids),
             row("g2", [GUARD, U1, A1, U2], at=61, pod="pod-a", cached=0, **ids),
             row("g3", [GUARD, U1, A1, U2, A2, U3], at=121, pod="pod-a", cached=None, **ids)])


def input_guard() -> tuple[Rows, Rows]:
    """The guardrail checks each user message before the chat call."""
    return ([row("t1", [SYS, U1], at=1, pod="pod-b", **C), row("t2", [SYS, U1, A1, U2], at=61, pod="pod-a", cached=0,
                                                                **C)],
            [row("g1", [GUARD, U1], at=0, pod="pod-a", **C), row("g2", [GUARD, U1, A1, U2], at=60, pod="pod-b",
                                                                  cached=0, **C)])


def graph_nodes(run: str = "") -> tuple[Rows, Rows]:
    """An agent graph's router node, then its responder, each turn, on one thread id (and, with ``run``, a run id per
    invocation, as LangGraph's thread_id and run_id): the router classifies the messages under ROUTER."""
    def ids(n: int) -> dict[str, str]:
        return {"conv": "thread-4", **({"run": f"{run}-{n}"} if run else {})}
    return ([row("a1", [SYS, U1], at=1, pod="pod-b", **ids(1)),
             row("a2", [SYS, U1, A1, U2], at=61, pod="pod-a", cached=0, **ids(2))],
            [row("r1", [ROUTER, U1], at=0, pod="pod-a", **ids(1)),
             row("r2", [ROUTER, U1, A1, U2], at=60, pod="pod-b", cached=0, **ids(2))])


def orchestrator() -> tuple[Rows, Rows]:
    """An orchestrator and a sub-agent of one agent run, both given the user's request word for word (one first
    message), each under its own system prompt, on alternating pods."""
    return ([row("o1", [SYS, U1], at=0, run="R", pod="pod-a"),
             row("o2", [SYS, U1, A1, U2], at=60, run="R", pod="pod-b", cached=0)],
            [row("s1", [RESEARCH_SYS, U1], at=5, run="R", pod="pod-b"),
             row("s2", [RESEARCH_SYS, U1, asst("Searching."), u("Tool result: three papers.")], at=61, run="R",
                 pod="pod-a", cached=0)])


def regenerate() -> tuple[Rows, Rows]:
    """The user regenerates turn 2's reply after its guardrail call: the same prompt again."""
    return ([row("t1", [SYS, U1], at=0, pod="pod-a", **C), row("t2", [SYS, U1, A1, U2], at=60, pod="pod-a", **C),
             row("t2r", [SYS, U1, A1, U2], at=70, pod="pod-a", cached=0, **C)],
            [row("g1", [GUARD, U1], at=1, pod="pod-b", **C), row("g2", [GUARD, U1, A1, U2], at=61, pod="pod-b", **C)])


def rewind() -> tuple[Rows, Rows]:
    """The user edits turn 2's question after turn 3 and its guardrail call (back one turn)."""
    return ([row("t2", [SYS, U1, A1, U2], at=60, pod="pod-a", **C),
             row("t3", [SYS, U1, A1, U2, A2, U3], at=120, pod="pod-a", **C),
             row("t2e", [SYS, U1, A1, EDITED], at=130, pod="pod-a", cached=0, **C)],
            [row("g3", [GUARD, U1, A1, U2, A2, U3], at=121, pod="pod-b", **C)])


def judge_on_reply() -> tuple[Rows, Rows]:
    """A judge checks each reply (its messages end with the assistant's)."""
    return ([row("t1", [SYS, U1], at=0, pod="pod-a", **C), row("t2", [SYS, U1, A1, U2], at=60, pod="pod-b", cached=0,
                                                                **C)],
            [row("j1", [GUARD, U1, A1], at=1, pod="pod-b", **C),
             row("j2", [GUARD, U1, A1, U2, A2], at=61, pod="pod-a", cached=0, **C)])


def memory_and_guard() -> tuple[Rows, Rows]:
    """A memory request under the chat's system prompt (its own first message) before the guardrail call."""
    return ([row("t1", [SYS, U1], at=0, pod="pod-a", **C),
             row("memory", [SYS, u("Extract durable facts from: " + U1["content"])], at=4, pod="pod-a", **C),
             row("t2", [SYS, U1, A1, U2], at=60, pod="pod-b", cached=0, **C)],
            [row("g1", [GUARD, U1], at=5, pod="pod-b", **C)])


def two_chats_on_one_id() -> tuple[Rows, Rows]:
    """Two chats under one id (a client that reuses a session id), each turn guarded."""
    return ([row("x1", [SYS, U1], at=0, pod="pod-a", **C), row("y1", [SYS, UX], at=10, pod="pod-b", **C),
             row("x2", [SYS, U1, A1, U2], at=60, pod="pod-a", cached=0, **C)],
            [row("gx1", [GUARD, U1], at=1, pod="pod-b", **C), row("gy1", [GUARD, UX], at=11, pod="pod-a", **C)])


def no_system_prompt() -> tuple[Rows, Rows]:
    """A chat without a system prompt, its UI's title request on the chat id, and a guardrail call."""
    return ([row("t1", [U1], at=0, pod="pod-a", **C), row("title", [TITLE], at=4, pod="pod-b", **C),
             row("t2", [U1, A1, U2], at=60, pod="pod-b", cached=0, **C)],
            [row("g1", [GUARD, U1], at=1, pod="pod-b", **C)])


def first_turn_retried(system: bool = True) -> tuple[Rows, Rows]:
    """The chat's first turn sent again after its guardrail call (a retry, a regenerate of the first reply): a first
    call (no history) whose id keys find only the guardrail's call (another system prompt, another thread's);
    the thread's own request under its system prompt is its previous turn (a hostile review's case)."""
    head = [SYS] if system else []
    return ([row("t1", [*head, U1], at=0, pod="pod-a", **C), row("t1r", [*head, U1], at=30, pod="pod-a", cached=0,
                                                                  **C)],
            [row("g1", [GUARD, U1], at=1, pod="pod-b", **C)])


SCENARIOS: dict[str, Callable[[], tuple[Rows, Rows]]] = {f.__name__: f for f in (
    guardrail, input_guard, graph_nodes, orchestrator, regenerate, rewind, judge_on_reply, memory_and_guard,
    two_chats_on_one_id, no_system_prompt, first_turn_retried)}
SCENARIOS["first_turn_retried_without_a_system_prompt"] = lambda: first_turn_retried(system=False)
SCENARIOS["guardrail_on_a_run_id"] = lambda: guardrail({"run": "run-1"})
SCENARIOS["graph_nodes_with_a_run_id_per_invocation"] = lambda: graph_nodes("inv")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_side_calls_under_another_system_prompt_change_no_answer(name: str) -> None:
    """Every request answers as its own calls alone would: the chat's without the side calls, the side calls'
    without the chat. Left out: a thread's first call (first message and system prompt) after a request of the
    other: one that carries the chat's history (a judge's or guardrail's first call in mid-chat) reads as the
    chat's next turn under a changed system prompt (`system_changed`: nothing tells the two apart), and one without
    a history skips the other's request but not back past it (a title request finds none where it found the
    chat's first turn; both all `unavoidable`)."""
    chat, side = SCENARIOS[name]()
    both = verdicts(*sorted(chat + side, key=lambda r: r["ts"]))
    compared = 0
    for mine, other in ((chat, side), (side, chat)):
        alone = verdicts(*mine)
        first_after = {r["request_id"] for r in mine if any(o["ts"] < r["ts"] for o in other) and not any(
            m["ts"] < r["ts"] and (m["first_message_hash"], m["system_norm_hash"]) == (
                r["first_message_hash"], r["system_norm_hash"]) for m in mine)}
        checked = [r["request_id"] for r in mine if r["request_id"] not in first_after]
        assert {k: both[k] for k in checked} == {k: alone[k] for k in checked}, (both, alone)
        compared += len(checked)
    assert compared >= 2


def test_a_chat_turn_takes_its_previous_turn_not_the_guardrail_call_between() -> None:
    """t2's previous turn is t1, not g1, the id's latest request: t1's full blocks were on pod-a, t2 on pod-b:
    routed_away, not system_changed. And g2's is g1 (on pod-b; g2 on pod-a); g1 is cold, not a changed system
    prompt of t1."""
    chat, side = guardrail()
    rows = chat + side
    got = verdicts(*rows)
    p = {r["request_id"]: r["prompt_tokens"] for r in rows}
    assert got["t2"]["pred"] == "t1" and got["g2"]["pred"] == "g1", got
    assert got["t2"]["causes"] == {("routed_away", ""): full(p["t1"]), ("unavoidable", ""): p["t2"] - full(p["t1"])}
    assert got["g2"]["causes"] == {("routed_away", ""): full(p["g1"]), ("unavoidable", ""): p["g2"] - full(p["g1"])}
    assert got["t3"]["pred"] == "t2" and got["g3"]["pred"] == "g2", got
    # g1, the guardrail's first call (no history), skips t1 (another system prompt): nothing held GUARD before
    assert got["g1"]["pred"] == "" and ("cold", "") in got["g1"]["causes"], got


def test_a_system_prompt_changed_for_the_chat_itself_is_still_a_drift() -> None:
    """Negative control: no request of the thread was sent with t2's system prompt before it (the chat's own prompt
    changed), so the id keys' turn stays the previous turn: system_changed."""
    other = {"role": "system", "content": SYS["content"].replace("Acme Copilot", "Globex Helper").replace(
        "concisely", "in detail").replace("acme CLI", "globex CLI")}
    rows = [row("t1", [SYS, U1], at=0, pod="pod-a", **C), row("t2", [other, U1, A1, U2], at=60, pod="pod-a",
                                                                 cached=0, **C)]
    got = verdicts(*rows)["t2"]
    assert got["pred"] == "t1" and ("prefix_drift", "system_changed") in got["causes"], got


def test_a_first_turn_sent_again_with_one_system_line_changed_is_still_its_thread() -> None:
    """A first turn sent again (no history) under its system prompt with one line changed (an id the masks do not
    know): the lines confirm one prompt, so the first send is its previous turn (volatile_system), not another
    thread's request (a hostile review found it read `cold`)."""
    changed = {"role": "system", "content": SYS["content"].replace("Acme Copilot", "Acme Assistant v2", 1)}
    rows = [row("t1", [SYS, U1], at=0, pod="pod-a", **C), row("t1b", [changed, U1], at=20, pod="pod-a", cached=0,
                                                                 **C)]
    got = verdicts(*rows)["t1b"]
    assert got["pred"] == "t1" and ("prefix_drift", "volatile_system") in got["causes"], got


def test_a_persona_switched_back_takes_the_last_turn_under_it() -> None:
    """A chat that moves to another system prompt for a turn and back: t3 takes t1, the thread's latest under its
    own system prompt, whose whole prompt t3's begins with (t2's shares nothing: another system prompt)."""
    other = {"role": "system", "content": "You are Globex Helper. Answer in verse. " * 12}
    rows = [row("t1", [SYS, U1], at=0, pod="pod-a", **C),
            row("t2", [other, U1, A1, U2], at=60, pod="pod-b", **C),
            row("t3", [SYS, U1, A1, U2, A2, U3], at=120, pod="pod-b", cached=0, **C)]
    got = verdicts(*rows)["t3"]
    assert got["pred"] == "t1" and ("routed_away", "") in got["causes"], got


def test_a_new_thread_under_the_chat_system_prompt_keeps_the_id_keys_turn() -> None:
    """Negative control: t3 starts over with a new first message under SYS after a guardrail call. No earlier request
    of its thread (its first message) exists under SYS, so the id keys' answer stands, as without keys 17 and 18."""
    rows = [row("t1", [SYS, U1], at=0, pod="pod-a", **C),
            row("t2", [SYS, U1, A1, U2], at=60, pod="pod-a", **C),
            row("g2", [GUARD, U1, A1, U2], at=61, pod="pod-b", **C),
            row("t3", [SYS, u("New topic: how do I export invoices as CSV?" * 3), asst("Use `acme billing export`."),
                       u("And for last year?")], at=120, pod="pod-a", cached=0, **C)]
    assert verdicts(*rows)["t3"]["pred"] == "g2"


def beyond_the_horizon() -> tuple[Rows, Rows]:
    """A first turn without a system prompt whose thread's only earlier request lies beyond the horizon (one hour)
    under another system prompt, other requests of the id within it (a hostile review's case: the lookback)."""
    ask = u("Please summarize the attached incident report and list the follow-up actions with owners." * 3)
    x = {"role": "system", "content": "You are an incident summarizer. Output bullet points only. " * 10}
    y = {"role": "system", "content": "You are a planning agent for the on-call team; write the plan. " * 10}
    return ([row("p", [x, ask], at=0, pod="pod-a", **C),
             row("q", [u("What are our SLOs for the ingest API? " * 5)], at=5000, pod="pod-a", **C),
             row("L", [y, u("Plan next week's on-call rotation for the platform team please. " * 4)], at=5100,
                 pod="pod-b", **C),
             row("z", [ask], at=5200, pod="pod-a", cached=0, **C)], [])


def guardrail_late_turn() -> tuple[Rows, Rows]:
    """:func:`guardrail` with t1 ingested after the rest (a collector outage replayed): t2 first reads g1."""
    chat, side = guardrail()
    return [*chat[1:], *side], chat[:1]


def rows_of(name: str) -> tuple[Rows, Rows]:
    """(first ingested, ingested after the first run) of a scenario: half and half, or as it says."""
    if name in STORE_ONLY:
        return STORE_ONLY[name]()
    chat, side = SCENARIOS[name]()
    rows = sorted(chat + side, key=lambda r: r["ts"])
    return rows[:len(rows) // 2], rows[len(rows) // 2:]


def line_changed(guarded: bool = False) -> tuple[Rows, Rows]:
    """:func:`test_a_first_turn_sent_again_with_one_system_line_changed_is_still_its_thread`'s rows (the store job
    reads the lines of an id key's candidate under another system prompt), with a guardrail call between or not."""
    changed = {"role": "system", "content": SYS["content"].replace("Acme Copilot", "Acme Assistant v2", 1)}
    return ([row("t1", [SYS, U1], at=0, pod="pod-a", **C),
             *([row("g1", [GUARD, U1], at=1, pod="pod-b", **C)] if guarded else [])],
            [row("t1b", [changed, U1], at=20, pod="pod-a", cached=0, **C)])


STORE_ONLY = {"beyond_the_horizon": beyond_the_horizon, "guardrail_late_turn": guardrail_late_turn,
              "line_changed": line_changed, "line_changed_guarded": lambda: line_changed(guarded=True)}


@pytest.mark.parametrize("runs", [1, 2])
@pytest.mark.parametrize("name", [*SCENARIOS, *STORE_ONLY])
def test_the_store_job_answers_as_the_reference(store, name, runs):  # type: ignore[no-untyped-def]
    """Every request, through the store job, in one run (the carried search) and in two, the later part ingested
    after the first run (an ASOF JOIN against request_keys, and the arrivals' successors judged again): the same
    causes and the same predecessor."""
    from test_attribution_job import insert_requests
    from test_attribution_job import run as run_job

    from tests.test_conversation_threads import B

    first, later = rows_of(name)
    if runs == 1:
        first, later = first + later, []
    insert_requests(store, stored(first, 3))
    run_job(store, default_block_size=B)
    if later:
        insert_requests(store, stored(later, 1))
        run_job(store, default_block_size=B)
    expected = verdicts(*first, *later)
    got: dict[str, dict[tuple[str, str], int]] = {}
    for r in store.query_rows("SELECT request_id, cause, sub_cause, tokens FROM miss_attribution"):
        got.setdefault(r[0], {})[(r[1], r[2])] = r[3]
    assert got == {k: v["causes"] for k, v in expected.items() if v["causes"]}, (got, expected)
    preds = {r[0]: (r[1], r[2]) for r in store.query_rows(
        "SELECT request_id, predecessor_request_id, predecessor_kind FROM request_attribution FINAL")}
    index = attribution.PredecessorIndex([*first, *later])
    kinds = {r["request_id"]: (p.request["request_id"], p.stored_kind) if (p := index.find(r)) else ("", "")
             for r in [*first, *later]}
    assert preds == kinds and {k: v[0] for k, v in kinds.items()} == {k: v["pred"] for k, v in expected.items()}
