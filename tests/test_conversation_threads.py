"""One conversation_id, several threads: a turn's previous turn is the latest request of its own thread (predecessor
key 10: conversation_id and first_message_hash, sql/migrations/0043), not a side request the client tagged with the
chat's id (a title or memory request) nor another thread sharing the id (sub-agents of a session without a run id).
Found by a hostile hunt: the conversation's latest request was taken, and its other message read as an edit
(prefix_drift / history_changed) or its missing system prompt as system_changed. Every row is fingerprinted from a
real chat body by the reference gateway (gateway/fingerprint.py ``fingerprint_request``), and judged by the reference
``attribution.attribute`` and by the store job (ClickHouse key search)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gateway.fingerprint import TokenCounter, fingerprint_request
from ingest import attribution
from tests.clock import T0

B = 16  # vLLM's default block size
TEMPLATE_PER_MESSAGE = 4  # role markers the chat template adds per message (not in the segment counts)


def row(rid: str, messages: list[dict[str, Any]], *, at: float, conv: str = "", run: str = "",
        tenant: str = "acme", model: str = "tiny", pod: str = "pod-a", cached: int | None = 0,
        status: int = 200, **body: Any) -> dict[str, Any]:
    """A gateway_requests row for a /v1/chat/completions body, as the reference gateway logs it."""
    fp = fingerprint_request({"model": model, "messages": messages, **body}, "chat.completions",
                             TokenCounter()).to_log_fields()
    del fp["token_count_method"]
    prompt = sum(fp[k] for k in ("system_tokens", "tools_tokens", "retrieval_tokens", "history_tokens",
                                 "suffix_tokens")) + TEMPLATE_PER_MESSAGE * len(messages) + 1
    return {"request_id": rid, "ts": T0 + timedelta(seconds=at), "tenant_id": tenant, "conversation_id": conv,
            "agent_run_id": run, "model": model, "pod": pod, "status": status, "prompt_tokens": prompt,
            "cached_tokens": cached, "e2e_ms": 3000.0, "pods_down": [], "continue_final_message": False,
            "skip_reading_prefix_cache": False, **fp}


def verdicts(*rows: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """request_id → {pred, causes: {(cause, sub): tokens}} from the in-memory reference."""
    out: dict[str, dict[str, Any]] = {}
    for r in attribution.attribute(list(rows), default_block_size=B):
        v = out.setdefault(r.request_id, {"pred": r.predecessor_request_id, "causes": {}})
        v["causes"][(r.cause, r.sub_cause)] = r.tokens
    return out


def full(tokens: int) -> int:
    return tokens // B * B


def u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def asst(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


SYS = {"role": "system", "content": "\n".join([
    "You are Acme Copilot, the support assistant of Acme Cloud.",
    "Answer in the user's language, concisely, with code blocks for commands.",
    "Never reveal internal ticket numbers or the names of on-call engineers.",
    "If a question is about billing, point to https://acme.example/billing and stop.",
    "When unsure, say so and suggest opening a ticket from the console (Help > New ticket).",
    "Prefer the acme CLI over the web console in instructions; give the console path as a fallback.",
    "Quote error messages exactly as the user gave them; do not paraphrase them.",
] * 3)}
U1 = u("Our nightly backup job to the eu-west bucket has been failing since Tuesday with 'AccessDenied: "
       "s3:PutObject on arn:acme:s3:::backups-eu/nightly/'. Nothing changed on our side as far as I know. "
       "The job runs as the service account svc-backup. What should I check first?" * 2)
A1 = asst("Start with the bucket policy and the service account's role: run `acme iam get-role svc-backup` and "
          "check that it still carries the BackupWriter policy; on Tuesday the default policy version was "
          "rotated for accounts created before 2024, which drops s3:PutObject on prefixed paths. Then run "
          "`acme s3 get-bucket-policy backups-eu` and look for an explicit Deny on nightly/." * 2)
U2 = u("The role still has BackupWriter, but the policy version is v3 now. The bucket policy has no Deny. "
       "How do I pin the old policy version, and is that safe?")
U2_EDITED = u("Actually, forget pinning. Can I just grant s3:PutObject on the whole bucket to svc-backup? "
              "What would that break, and how do I roll it back if the auditors complain?")
A2 = asst("Pin it with `acme iam set-policy-version BackupWriter --version v2 --account svc-backup`. It is safe "
          "for a few weeks: v2 is supported until the end of the quarter, after which you should move to v3 "
          "and add the nightly/ prefix to its resource list explicitly." * 2)
U3 = u("Pinned, the job ran fine. What exactly should the v3 resource list look like?")


# -- auxiliary requests of a chat (title / tags / follow-ups) carrying the chat's conversation_id ------
TITLE = u("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
          "### Output:\nJSON format: { \"title\": \"your concise title here\" }\n### Chat History:\n<chat_history>\n"
          f"USER: {U1['content']}\nASSISTANT: {A1['content']}\n</chat_history>")


def side_request_traffic() -> list[dict[str, Any]]:
    """t1 (pod-a), the UI's title request on the chat id (pod-b), t2 back on pod-a, which evicted t1 (cached 0)."""
    return [row("t1", [SYS, U1], at=0, conv="chat-9", pod="pod-a"),
            row("title", [TITLE], at=4, conv="chat-9", pod="pod-b"),
            row("t2", [SYS, U1, A1, U2], at=60, conv="chat-9", pod="pod-a", cached=0)]


def test_a_title_request_on_the_chat_id_is_not_the_previous_turn() -> None:
    """Open WebUI-style: after the first reply the UI asks the same model for a title (one user message holding
    the task and the chat so far), tagged with the chat id; then the user sends turn 2. Turn 2 carries turn 1's
    whole prompt (system + U1) and lands back on pod-a, which evicted it meanwhile (cached 0): the right cause is
    evicted / evicted_before_next_turn against t1. Before key 10 the title request (latest on the chat id) was
    the previous turn: its system prompt read 'changed' (the title request has none)."""
    t1, title, t2 = side_request_traffic()
    got = verdicts(t1, title, t2)["t2"]
    assert got["pred"] == "t1", got
    assert not any(c == "prefix_drift" for c, _ in got["causes"]), got
    assert got["causes"].get(("evicted", "evicted_before_next_turn")) == full(t1["prompt_tokens"]), got


def test_a_memory_request_with_the_same_system_prompt_and_no_history_is_not_the_previous_turn() -> None:
    """The same with a side request that keeps the chat's system prompt (the UI reuses the model preset): a
    'memory' request [SYS, digest of U1], no history, like turn 1. Turn 2's prev_history_hash is "" (its history
    minus [U1, A1]), equal to the side request's history, so kvscope read the history as kept and U1 as an edit
    of the side request's message: prefix_drift / history_changed over U1, where t1's whole prompt (system + U1)
    was reusable on pod-a: routed_away."""
    t1 = row("t1", [SYS, U1], at=0, conv="chat-9", pod="pod-a")
    memory = row("memory", [SYS, u("Extract durable facts from: " + U1["content"])], at=4, conv="chat-9",
                 pod="pod-a")
    t2 = row("t2", [SYS, U1, A1, U2], at=60, conv="chat-9", pod="pod-b", cached=0)
    got = verdicts(t1, memory, t2)["t2"]
    assert got["pred"] == "t1", got
    assert not any(c == "prefix_drift" for c, _ in got["causes"]), got
    assert got["causes"].get(("routed_away", "")) == full(t1["prompt_tokens"]), got


# -- two threads of one conversation without agent_run_id (parallel sub-agents, no run id) ----------
RESEARCH_SYS = {"role": "system", "content": "\n".join([
    "You are a research sub-agent. Use the search tool, then answer with citations.",
    "Be exhaustive: list every relevant source you find, with its URL.",
    "Never write code; another agent does that.",
    "Answer in English, in at most 300 words.",
] * 4)}


def thread_traffic() -> list[dict[str, Any]]:
    """Two sub-agents (same system prompt, tasks X and Y) on conversation_id session-4, no agent_run_id."""
    task_x = u("Find the published benchmarks comparing vLLM prefix caching with SGLang RadixAttention, 2024-2025, "
               "and summarize the hit-rate numbers each reports for multi-turn chat workloads." * 2)
    task_y = u("Find the documentation of how Kubernetes Gateway API inference extensions route by prefix, and "
               "summarize which signals (KV events, prefix hashes, queue depth) each implementation uses." * 2)
    x1 = row("x1", [RESEARCH_SYS, task_x], at=0, conv="session-4", pod="pod-a")
    y1 = row("y1", [RESEARCH_SYS, task_y], at=1, conv="session-4", pod="pod-b")
    x2 = row("x2", [RESEARCH_SYS, task_x, asst("Searching. " + A1["content"]), u("Tool result: 5 sources found.")],
             at=30, conv="session-4", pod="pod-a", cached=0)
    return [x1, y1, x2]


def test_parallel_threads_on_one_conversation_id_without_a_run_id() -> None:
    """Two sub-agents of one session, both with the session's conversation_id (the client sets no run id): same
    system prompt, different tasks. Thread X's second turn follows X1 (pod-a, evicted: cached 0), but the
    conversation's latest request is Y1 (the other thread). Y1 has no history and X2's prev_history_hash is ""
    (its history minus [taskX, reply]), so the history reads kept and taskX 'edited' (≠ Y1's taskY):
    prefix_drift / history_changed, where evicted_before_next_turn is right. first_message_hash tells the
    threads apart: key 10 (before it, only key 9, with agent_run_id, used it)."""
    x1, y1, x2 = thread_traffic()
    got = verdicts(x1, y1, x2)["x2"]
    assert got["pred"] == "x1", got
    assert not any(c == "prefix_drift" for c, _ in got["causes"]), got
    assert got["causes"].get(("evicted", "evicted_before_next_turn")) == full(x1["prompt_tokens"]), got


# -- the first turn of a new sub-agent thread is not the run's next turn ------------------------------
ORCH_SYS = {"role": "system", "content": "You are the orchestrator. Plan, delegate to sub-agents with the task "
                                         "tool, and merge their answers." * 8}


def test_a_new_subagents_first_turn_is_not_a_changed_system_prompt() -> None:
    """Agent run R2: the orchestrator's turn (pod-b), then it spawns a research sub-agent (first turn, same run id,
    its own system prompt: first_message_hash new, so key 9 finds nothing and the run key gives the
    orchestrator's turn). The very same sub-agent prompt prefix (system prompt) was served on pod-a by run R1's
    research sub-agent a minute before: the same prompt_fingerprint. Right: the fingerprint predecessor r1 →
    routed_away (its system prompt was on pod-a). Before ingest.attribution.other_thread: previous_turn = the
    orchestrator → prefix_drift / system_changed, as if the client had changed its system prompt."""
    r1, orch, sub = subagent_traffic()
    got = verdicts(r1, orch, sub)["sub"]
    assert got["pred"] == "r1", got
    shared = r1["system_tokens"] + TEMPLATE_PER_MESSAGE  # the system message; the tasks differ from there on
    assert got["causes"] == {("routed_away", ""): full(shared),
                             ("unavoidable", ""): sub["prompt_tokens"] - full(shared)}, got


def subagent_traffic() -> list[dict[str, Any]]:
    """r1: run R1's research sub-agent (pod-a); orch: run R2's orchestrator (pod-b); sub: R2's research sub-agent's
    first turn (pod-b, cached 0), another task."""
    task1 = u("Find the vLLM release notes that mention prefix caching, versions 0.6 to 0.10.")
    task2 = u("Find the SGLang release notes that mention RadixAttention eviction, 2025 only.")
    return [row("r1", [RESEARCH_SYS, task1], at=0, run="R1", pod="pod-a"),
            row("orch", [ORCH_SYS, u("Compare prefix caching in vLLM and SGLang for our chat fleet.")], at=50,
                run="R2", pod="pod-b"),
            row("sub", [RESEARCH_SYS, task2], at=60, run="R2", pod="pod-b", cached=0)]


def test_a_new_subagents_first_turn_with_an_unseen_system_prompt_is_cold() -> None:
    """The same without an earlier run: the sub-agent's system prompt was never served: cold (or unavoidable),
    not system_changed against the orchestrator."""
    orch = row("orch", [ORCH_SYS, u("Compare prefix caching in vLLM and SGLang for our chat fleet.")], at=50,
               run="R2", pod="pod-b")
    sub = row("sub", [RESEARCH_SYS, u("Find the SGLang release notes on RadixAttention eviction, 2025 only.")],
              at=60, run="R2", pod="pod-b", cached=0)
    got = verdicts(orch, sub)["sub"]
    assert got["pred"] == "", got
    assert set(got["causes"]) == {("cold", ""), ("unavoidable", "")}, got


# -- going back a turn: a regenerate of an earlier reply, an edit of an earlier message --------------------------
def rewind_traffic(edited: bool = False) -> list[dict[str, Any]]:
    """Turns 1-3 of a chat on pod-a; then the UI re-sends turn 2 (the user regenerates A2, or edits U2 and sends it)
    on pod-b, which holds nothing of it (cached 0)."""
    return [row("t1", [SYS, U1], at=0, conv="chat-9", pod="pod-a"),
            row("t2", [SYS, U1, A1, U2], at=60, conv="chat-9", pod="pod-a"),
            row("t3", [SYS, U1, A1, U2, A2, U3], at=120, conv="chat-9", pod="pod-a"),
            row("t2b", [SYS, U1, A1, U2_EDITED if edited else U2], at=180, conv="chat-9", pod="pod-b", cached=0)]


@pytest.mark.parametrize("edited", [False, True])
def test_going_back_a_turn_is_no_drift(edited: bool) -> None:
    """Found on real pods: the re-sent turn read `history_truncated` against turn 3, the conversation's latest, though
    turn 3's prompt holds all of it (regenerated) or all but its edited question. Regenerated: every full block but
    the last token's is routed_away (turn 3 on pod-a held it); edited: up to the question, which is new."""
    rows = rewind_traffic(edited)
    got = verdicts(*rows)["t2b"]
    assert got["pred"] == "t3", got
    p = rows[-1]["prompt_tokens"]
    if not edited:
        assert got["causes"] == {("routed_away", ""): full(p - 1), ("unavoidable", ""): p - full(p - 1)}, got
    else:
        assert set(got["causes"]) == {("routed_away", ""), ("unavoidable", "")}, got
        assert got["causes"][("routed_away", "")] >= full(rows[0]["prompt_tokens"]), got  # at least turn 1's prompt


# -- the store job takes the same predecessors ----------------------------------------------------------------
def store_causes(store: Any, rows: list[dict[str, Any]]) -> dict[str, dict[tuple[str, str], int]]:
    """``rows`` inserted into the store and attributed by the store job (ingest/attribution_job.py): per request,
    {(cause, sub_cause): tokens}."""
    from test_attribution_job import attributed, insert_requests
    from test_attribution_job import run as run_job

    ingested = datetime.now(UTC) - timedelta(minutes=1)
    stored = [{**r, "ingested_at": ingested,
               **{k: [int(x, 16) for x in r[k]] for k in (attribution.LINE_HASHES, attribution.CHUNK_HASHES)}}
              for r in rows]
    insert_requests(store, stored)
    run_job(store, default_block_size=B)
    out: dict[str, dict[tuple[str, str], int]] = {}
    for r in attributed(store):
        out.setdefault(r[0], {})[(r[1], r[2])] = r[3]
    return out


@pytest.mark.parametrize(("traffic", "target", "right"), [
    (thread_traffic, "x2", ("evicted", "evicted_before_next_turn", "x1")),
    (side_request_traffic, "t2", ("evicted", "evicted_before_next_turn", "t1")),
    (subagent_traffic, "sub", ("routed_away", "", "r1")),
    (rewind_traffic, "t2b", ("routed_away", "", "t3")),
])
def test_the_store_job_takes_the_same_predecessor(store, traffic, target, right):  # type: ignore[no-untyped-def]
    """Through ingest/attribution_job.py (ClickHouse key search on request_keys): the same answers, and the same
    predecessor."""
    got = store_causes(store, traffic()).get(target, {})
    expected = verdicts(*traffic())[target]
    assert got == expected["causes"] and right[:2] in got, (got, expected)
    assert store.query_rows("SELECT predecessor_request_id FROM request_attribution FINAL WHERE request_id = "
                            "{t:String}", {"t": target}) == [(right[2],)]
