"""Clients that send no conversation or run id (a plain OpenAI client): a turn's previous turn is found by its
messages (predecessor key 11, ``attribution.KEY_MESSAGES``, sql/migrations/0045), not taken to be the latest request
with the same system prompt. Found by a hostile hunt on real pods: on an app whose users share one system prompt,
another user's request came between two turns, so turn 2's predecessor was that request (a variant) and its own
history read as new content (``routed_away`` 416 for the system prompt alone, where turn 1's whole prompt was
reusable). Rows are fingerprinted from real chat bodies by the reference gateway and judged by the reference
``attribution.attribute`` and by the store job (ClickHouse key search)."""

from __future__ import annotations

from typing import Any

import pytest

from ingest import attribution
from tests.test_conversation_threads import A1, A2, SYS, U1, U2, U3, asst, full, row, store_causes, u, verdicts

UB1 = u("How do I rotate the API key of a service account without downtime? We have three consumers of it. " * 3)
AB1 = asst("Use acme iam rotate-key with --grace 24h, then roll the consumers one by one.")
UB2 = u("And with two keys at once?")
OTHER_SYS = {"role": "system", "content": "You are the Acme billing assistant. Only answer billing questions."}


def interleaved() -> list[dict[str, Any]]:
    """Two users of one app (one system prompt, no ids), their turns interleaved: a1 on pod-a, b1 on pod-a, a2 on
    pod-b (cached 0), b2 back on pod-a (evicted meanwhile, cached 0), a3 on pod-a (cached 0)."""
    return [row("a1", [SYS, U1], at=0, pod="pod-a"),
            row("b1", [SYS, UB1], at=5, pod="pod-a"),
            row("a2", [SYS, U1, A1, U2], at=30, pod="pod-b"),
            row("b2", [SYS, UB1, AB1, UB2], at=40, pod="pod-a"),
            row("a3", [SYS, U1, A1, U2, A2, U3], at=50, pod="pod-a")]


def test_a_turn_without_ids_takes_its_previous_turn_not_another_users_request() -> None:
    """a2's previous turn is a1 (its history carries a1's messages), not b1, the latest request with the same
    system prompt: a1's whole prompt in full blocks is ``routed_away`` (a2 went to pod-b), not the system prompt
    alone. b2's is b1 on its own pod: ``evicted_before_next_turn``. a3's is a2, on pod-b."""
    rows = interleaved()
    got = verdicts(*rows)
    by_id = {r["request_id"]: r for r in rows}
    assert got["a2"]["pred"] == "a1", got["a2"]
    assert got["a2"]["causes"] == {("routed_away", ""): full(by_id["a1"]["prompt_tokens"]),
                                   ("unavoidable", ""): by_id["a2"]["prompt_tokens"]
                                   - full(by_id["a1"]["prompt_tokens"])}, got["a2"]
    assert got["b2"]["pred"] == "b1", got["b2"]
    assert got["b2"]["causes"].get(("evicted", "evicted_before_next_turn")) == full(by_id["b1"]["prompt_tokens"])
    assert got["a3"]["pred"] == "a2", got["a3"]
    assert got["a3"]["causes"].get(("routed_away", "")) == full(by_id["a2"]["prompt_tokens"]), got["a3"]


def edited() -> list[dict[str, Any]]:
    """A user edits turn 2's message and sends it again (the same history, another final message) after another
    user's request on the same pod."""
    return [*interleaved()[:3], row("b1x", [SYS, UB1], at=31, pod="pod-b"),
            row("a2x", [SYS, U1, A1, u("Forget that: can I grant s3:PutObject on the whole bucket?")], at=35,
                pod="pod-b")]


def with_ids(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same traffic from a client that tags each user's chat with a conversation id (its first letter)."""
    return [{**r, "conversation_id": "chat-" + r["request_id"][0]} for r in rows]


def test_without_ids_the_answers_are_those_with_ids() -> None:
    """Every request gets the predecessor and the causes it gets when the client sends conversation ids."""
    assert verdicts(*interleaved()) == verdicts(*with_ids(interleaved()))


def test_an_edited_last_message_takes_the_request_it_replaces() -> None:
    """A user edits turn 2's message and sends it again: the same system prompt and history as a2 (the fingerprint
    key's match), later than the previous turn key 12 finds (a1), takes its place as the previous turn: the
    answer ids give."""
    got = verdicts(*edited())
    assert got["a2x"]["pred"] == "a2", got["a2x"]
    assert got == verdicts(*with_ids(edited()))


def test_the_same_first_message_under_another_system_prompt_is_no_previous_turn() -> None:
    """Negative control: the messages key holds the normalized system prompt, so a first message another app's
    user also sent ('hi') under another system prompt finds no predecessor on it."""
    rows = [row("x1", [SYS, u("hi")], at=0, pod="pod-a"), row("y1", [OTHER_SYS, u("hi")], at=5, pod="pod-a"),
            row("y2", [OTHER_SYS, u("hi"), asst("Hello! How can I help with billing?"), u("my invoice")], at=9,
                pod="pod-a")]
    got = verdicts(*rows)
    assert got["y1"]["pred"] == "", got["y1"]
    assert got["y2"]["pred"] == "y1", got["y2"]


def faq() -> list[dict[str, Any]]:
    """A one-shot app: two users send the same question under the same system prompt, the second on the pod that
    served the first, which evicted it meanwhile (cached 0)."""
    question = u("What is the refund policy for annual plans cancelled in the first month? " * 4)
    return [row("q1", [SYS, question], at=0, pod="pod-a"), row("q2", [SYS, question], at=90, pod="pod-a")]


def test_the_same_question_from_two_users_is_no_previous_turn() -> None:
    """Negative control: the same messages are not a turn of one conversation (key 11 is found, never looked up).
    q2's predecessor is q1 as the same prompt (``fingerprint``): its miss is ``evicted``, not
    ``evicted_before_next_turn``, and the turn-gap analyses do not count it."""
    q1, q2 = faq()
    pred = attribution.PredecessorIndex([q1]).find(q2)
    assert pred is not None and pred.request is q1 and pred.kind == attribution.FINGERPRINT, pred
    assert set(verdicts(q1, q2)["q2"]["causes"]) == {("evicted", ""), ("unavoidable", "")}


def test_ids_still_win() -> None:
    """A client that sends a conversation id finds its turns on the id keys: its requests have no messages keys
    (each would cost the predecessor search a row per request), so another conversation's request that sent the
    same messages is never its previous turn."""
    rows = [row("t1", [SYS, U1], at=0, conv="c-1", pod="pod-a"),
            row("t1b", [SYS, U1], at=2, conv="c-2", pod="pod-b"),
            row("t2", [SYS, U1, A1, U2], at=9, conv="c-1", pod="pod-a")]
    assert verdicts(*rows)["t2"]["pred"] == "t1"
    assert not {k for k, _ in attribution.predecessor_keys(rows[2])} & {*attribution.MESSAGE_LOOKUPS,
                                                                        *attribution.MESSAGE_FOUND_KINDS}
    assert {k for k, _ in attribution.predecessor_keys({**rows[2], "conversation_id": ""})} >= {11, 12, 13, 14, 16}


@pytest.mark.parametrize(("target", "pred"), [("a2", "a1"), ("b2", "b1"), ("a3", "a2")])
def test_the_store_job_takes_the_same_previous_turn(store, target, pred):  # type: ignore[no-untyped-def]
    """Through ingest/attribution_job.py (ClickHouse key search on request_keys, keys 11 and 12 from the MATERIALIZED
    predecessor_keys of migration 0045): the same answers, and the same predecessor."""
    got = store_causes(store, interleaved()).get(target, {})
    expected = verdicts(*interleaved())[target]
    assert got == expected["causes"], (got, expected)
    assert store.query_rows("SELECT predecessor_request_id, predecessor_kind FROM request_attribution FINAL "
                            "WHERE request_id = {t:String}", {"t": target}) == [(pred, attribution.PREVIOUS_TURN)]


@pytest.mark.parametrize("system", [True, False])
def test_the_store_job_does_not_take_the_same_question_as_a_turn(store, system):  # type: ignore[no-untyped-def]
    """The store job does not look a request's own messages up (key 11), as the reference: q1 is q2's predecessor as
    the same prompt (key 3: without a system prompt, on the message itself), never a previous turn (a key 11 looked
    up named q1 a turn)."""
    rows = faq() if system else faq_without_system()
    assert store_causes(store, rows)["q2"] == verdicts(*rows)["q2"]["causes"]
    assert store.query_rows("SELECT predecessor_request_id, predecessor_kind FROM request_attribution FINAL "
                            "WHERE request_id = 'q2'") == [("q1", attribution.FINGERPRINT)]


# -- kinds a hostile review found on the first version (siblings taken as turns, salts, user-only turns) ----------
def same_first_message() -> list[dict[str, Any]]:
    """Two users whose chats start with the same message (a suggested prompt), their turns interleaved; b2 on
    b1's pod, evicted meanwhile (cached 0)."""
    return [row("a1", [SYS, U1], at=0, pod="pod-a"), row("b1", [SYS, U1], at=5, pod="pod-b"),
            row("a2", [SYS, U1, A1, U2], at=20, pod="pod-a"),
            row("b2", [SYS, U1, asst("Check the role first. " * 10), U3], at=30, pod="pod-b")]


def salted_without_system() -> list[dict[str, Any]]:
    """Two users with their own cache_salt and no system prompt, the same first message; each next turn on its
    first turn's pod, evicted meanwhile."""
    return [row("a1", [U1], at=0, pod="pod-a", cache_salt="user-a"),
            row("b1", [U1], at=5, pod="pod-b", cache_salt="user-b"),
            row("a2", [U1, A1, U2], at=20, pod="pod-a", cache_salt="user-a"),
            row("b2", [U1, A2, U3], at=30, pod="pod-b", cache_salt="user-b")]


def few_shot() -> list[dict[str, Any]]:
    """A one-shot classifier with a fixed example exchange, and a chat app that opens with a welcome message:
    two users each, the second on the first's pod."""
    example = [u("Classify: 'the invoice is wrong' ->"), asst("billing")]
    welcome = asst("Hi! I am the Acme assistant. Ask me anything about your account. " * 3)
    return [row("f1", [SYS, *example, u("Classify: 'my backup fails' ->")], at=0, pod="pod-a"),
            row("w1", [SYS, welcome, u("How do I reset my password?")], at=100, pod="pod-a"),
            row("f2", [SYS, *example, u("Classify: 'cannot log in' ->")], at=190, pod="pod-a"),
            row("w2", [SYS, welcome, u("Where are my invoices?")], at=290, pod="pod-a")]


def user_only_turns() -> list[dict[str, Any]]:
    """A user who writes three more messages before any reply comes, each request on another pod, the last on
    the pod of the one before it, evicted meanwhile."""
    m2, m3, m4 = u("also: the bucket is versioned"), u("and it has object lock on"), u("fourth: any idea?")
    return [row("t1", [SYS, U1], at=0, pod="pod-a"), row("t2", [SYS, U1, m2], at=2, pod="pod-b"),
            row("t3", [SYS, U1, m2, m3], at=4, pod="pod-c"), row("t4", [SYS, U1, m2, m3, m4], at=6, pod="pod-c")]


def test_a_user_whose_chat_starts_like_another_takes_its_own_previous_turn() -> None:
    """b2's previous turn is the latest request that sent [SYS, U1], b1, not a2 (which names the same previous
    messages but sent others): no drift is read into b2's history. a2 takes b1 as well (the same prefix, held on
    pod-b): its miss is that prefix on the other pod, no drift either."""
    got = verdicts(*same_first_message())
    assert got["b2"]["pred"] == "b1" and got["a2"]["pred"] == "b1", got
    assert got["b2"]["causes"] == verdicts(*with_ids(same_first_message()))["b2"]["causes"], got["b2"]
    assert not any(c == "prefix_drift" for v in got.values() for c, _ in v["causes"]), got


def test_salted_users_without_a_system_prompt_keep_their_own_turns() -> None:
    """The messages keys hold the cache_salt: each user's next turn takes its own first turn, no
    cache_salt_changed (the answers with ids)."""
    got = verdicts(*salted_without_system())
    assert got["a2"]["pred"] == "a1" and got["b2"]["pred"] == "b1", got
    assert got == verdicts(*with_ids(salted_without_system()))


def test_fixed_leading_messages_of_a_one_shot_app_are_no_previous_turn() -> None:
    """Few-shot examples and a welcome message repeat in every user's request: no request sent them as its own
    messages, so the second user's request is no turn of the first's (``fingerprint`` or ``variant``, plain
    ``evicted``)."""
    rows = few_shot()
    by_id = {r["request_id"]: r for r in rows}
    index = attribution.PredecessorIndex(rows)
    for first, second in (("f1", "f2"), ("w1", "w2")):
        pred = index.find(by_id[second])
        assert pred is not None and pred.request is by_id[first] and pred.kind != attribution.PREVIOUS_TURN, pred
        assert ("evicted", "evicted_before_next_turn") not in verdicts(*few_shot())[second]["causes"]


def test_user_only_turns_take_the_request_just_before() -> None:
    """A message sent before the reply came re-sends the previous request's messages as its history (key 14 against
    the previous request's next_history_hash): t4's previous turn is t3, as with ids, not t2."""
    got = verdicts(*user_only_turns())
    assert [got[t]["pred"] for t in ("t2", "t3", "t4")] == ["t1", "t2", "t3"], got
    assert got == verdicts(*with_ids(user_only_turns()))


def regenerate() -> list[dict[str, Any]]:
    """A user regenerates turn 2 (the same messages sent again, on a third pod)."""
    return [row("a1", [SYS, U1], at=0, pod="pod-a"), row("a2", [SYS, U1, A1, U2], at=10, pod="pod-b"),
            row("a2r", [SYS, U1, A1, U2], at=20, pod="pod-c")]


def prefill() -> list[dict[str, Any]]:
    """Turn 1 ends in an assistant prefill vLLM continues (continue_final_message); turn 2 carries the prefill
    completed, on turn 1's pod, after another user's request there."""
    pre = asst("Sure. Step one:")
    return [{**row("a1", [SYS, U1, pre], at=0, pod="pod-a", continue_final_message=True),
             "continue_final_message": True},
            row("b1", [SYS, u("How do I rotate a key? " * 5)], at=5, pod="pod-a"),
            row("a2", [SYS, U1, asst("Sure. Step one: check the role."), U2], at=10, pod="pod-a")]


def stored(rows: list[dict[str, Any]], minutes_ago: int) -> list[dict[str, Any]]:
    """``rows`` as the store job reads them, ingested ``minutes_ago`` (line and chunk hashes as integers)."""
    from datetime import UTC, datetime, timedelta

    at = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    return [{**r, "ingested_at": at, **{k: [int(x, 16) for x in r[k]]
                                       for k in (attribution.LINE_HASHES, attribution.CHUNK_HASHES)}} for r in rows]


def faq_without_system() -> list[dict[str, Any]]:
    """:func:`faq` with no system prompt: the same prompt (key 3 on the message itself) finds the same question."""
    question = u("What is the refund policy for annual plans cancelled in the first month? " * 4)
    return [row("q1", [question], at=0, pod="pod-a"), row("q2", [question], at=90, pod="pod-a")]


def beyond_horizon() -> list[dict[str, Any]]:
    """The same question without a system prompt two hours apart, and a user's next turn two hours after the
    first (beyond the default horizon of one hour, within the lookback): the lookback's search by id."""
    question = u("What is the refund policy for annual plans cancelled in the first month? " * 4)
    return [row("q1", [question], at=0, pod="pod-a"), row("a1", [SYS, U1], at=10, pod="pod-a"),
            row("q2", [question], at=7200, pod="pod-a"), row("a2", [SYS, U1, A1, U2], at=7210, pod="pod-b")]


@pytest.mark.parametrize("runs", [1, 2])
@pytest.mark.parametrize("traffic", [same_first_message, salted_without_system, few_shot, user_only_turns, edited,
                                     faq, faq_without_system, beyond_horizon, regenerate, prefill])
def test_the_store_job_answers_as_the_reference(store, traffic, runs):  # type: ignore[no-untyped-def]
    """Every request of each kind, through the store job: the same causes and the same predecessor. In one run
    (a backlog: the search carried from chunk to chunk, ingest/key_tails.py) and in two, the later half ingested
    after the first run (an ASOF JOIN against request_keys, and the successors of the arrivals re-judged)."""
    assert_store_answers_as_reference(store, traffic(), runs)


def assert_store_answers_as_reference(store: Any, rows: list[dict[str, Any]], runs: int) -> dict[str, str]:
    """``rows`` attributed by the store job, in one run (all ingested 3 minutes ago) or two (the later half ingested
    a minute ago, after the first run), give the reference's causes and predecessors; returns request id →
    predecessor id."""
    from test_attribution_job import insert_requests
    from test_attribution_job import run as run_job

    from tests.test_conversation_threads import B

    half = len(rows) // 2 if runs == 2 else len(rows)
    insert_requests(store, stored(rows[:half], 3))
    run_job(store, default_block_size=B)
    if runs == 2:
        insert_requests(store, stored(rows[half:], 1))
        run_job(store, default_block_size=B)
    expected = verdicts(*rows)
    got: dict[str, dict[tuple[str, str], int]] = {}
    for r in store.query_rows("SELECT request_id, cause, sub_cause, tokens FROM miss_attribution"):
        got.setdefault(r[0], {})[(r[1], r[2])] = r[3]
    assert got == {k: v["causes"] for k, v in expected.items() if v["causes"]}, (got, expected)
    preds = dict(store.query_rows("SELECT request_id, predecessor_request_id FROM request_attribution FINAL"))
    assert preds == {k: v["pred"] for k, v in expected.items()}
    return preds


def test_a_previous_turn_that_arrives_late_is_taken_when_it_lands(store):  # type: ignore[no-untyped-def]
    """a1 reaches the store after a2, b2 and a3 were answered (a collector outage replayed): the next run re-judges
    the requests that look a1's messages up (key 12 finds a1's key 11; such rows are no candidates, so the
    successor search takes every one of them on the arrival's keys), and every answer is then the reference's."""
    from test_attribution_job import insert_requests
    from test_attribution_job import run as run_job

    from tests.test_conversation_threads import B

    rows = interleaved()
    insert_requests(store, stored([r for r in rows if r["request_id"] != "a1"], 3))
    run_job(store, default_block_size=B)
    assert store.query_rows("SELECT predecessor_request_id FROM request_attribution FINAL WHERE request_id = 'a2'") \
        == [("b1",)]
    insert_requests(store, stored([r for r in rows if r["request_id"] == "a1"], 1))
    run_job(store, default_block_size=B)
    preds = dict(store.query_rows("SELECT request_id, predecessor_request_id FROM request_attribution FINAL"))
    assert preds == {k: v["pred"] for k, v in verdicts(*rows).items()}


def test_a_regenerate_takes_the_request_it_repeats() -> None:
    """The same messages sent again after turn 2 (a regenerate or retry): the fingerprint key's match, later than
    the previous turn key 12 found, takes its place as the previous turn (as with ids): a2's whole prompt."""
    got = verdicts(*regenerate())
    assert got["a2r"]["pred"] == "a2", got
    assert got == verdicts(*with_ids(regenerate()))


def test_the_turn_after_an_assistant_prefill_takes_the_prefill() -> None:
    """Key 16 (the history before the last assistant run) finds the prefill request's key 15: the answer ids give."""
    got = verdicts(*prefill())
    assert got["a2"]["pred"] == "a1", got
    assert got == verdicts(*with_ids(prefill()))
