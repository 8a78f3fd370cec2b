"""The demo workload (demo/workload.py): deterministic labels, each pathology really present in the requests,
and the sending loop (against httpx.MockTransport; the real-vLLM check is marked `vllm`)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from demo.workload import PATHOLOGIES, TENANTS, iter_sessions, plan_labels, run_workload

NOW = datetime(2026, 11, 29, 12, 0, 0, 123000, tzinfo=UTC)
OUTCOME_FIELDS = ("status", "http_status", "prompt_tokens", "cached_tokens", "ts", "run_id")  # set when sent


def sessions_of(tenant: str, seed: int = 0, scale: float = 1.0) -> list:  # type: ignore[type-arg]
    return sorted((s for s in iter_sessions(seed, scale) if s.tenant.name == tenant), key=lambda s: s.index)


def play(session, reply: str = "Noted.") -> list[tuple[dict, dict]]:  # type: ignore[no-untyped-def]
    """Every request of a session, replies recorded as the sender would."""
    out = []
    for turn in range(1, len(session.turns) + 1):
        out.append(session.request(turn, NOW + timedelta(seconds=turn)))
        session.record_reply(turn, reply)
    return out


def test_labels_are_deterministic_per_seed() -> None:
    assert plan_labels(seed=3) == plan_labels(seed=3)
    assert plan_labels(seed=3) != plan_labels(seed=4)


def test_labels_cover_every_tenant_and_pathology_at_a_demo_size() -> None:
    labels = plan_labels(seed=0, scale=1.0)
    assert 50 <= len(labels) <= 80
    assert {lb["tenant_id"] for lb in labels} == {t.name for t in TENANTS}
    assert set(Counter(lb["pathology"] for lb in labels)) == set(PATHOLOGIES)
    assert len({lb["request_id"] for lb in labels}) == len(labels)
    assert len(plan_labels(seed=0, scale=2.0)) > len(labels)
    hooli = [lb for lb in labels if lb["tenant_id"] == "hooli"]
    assert {lb["pathology"] for lb in hooli if lb["turn"] < 3} == {"none"}
    assert {lb["pathology"] for lb in hooli if lb["turn"] >= 3} == {"history_truncated"}
    assert {lb["scenario"] for lb in hooli} == {"history_truncated"}  # the session's, whatever the turn
    agent = [lb for lb in labels if lb["tenant_id"] == "initech"]
    assert all(lb["agent_run_id"] == lb["conversation_id"] for lb in agent)
    assert all(200 <= lb["tool_wait_ms"] <= 1000 for lb in agent if lb["turn"] > 1)


def test_ids_follow_tenant_session_turn() -> None:
    labels = plan_labels(seed=0)
    assert "acme-c0-t1" in {lb["request_id"] for lb in labels}
    assert "initech-r0-t2" in {lb["request_id"] for lb in labels}
    session = sessions_of("initech")[0]
    headers, _ = session.request(1, NOW)
    assert headers == {"X-Tenant-Id": "initech", "X-Conversation-Id": "initech-r0",
                       "X-Request-Id": "initech-r0-t1", "X-Agent-Run-Id": "initech-r0"}  # fmt: skip


def test_acme_keeps_full_history_and_a_stable_system_prompt() -> None:
    requests = play(sessions_of("acme")[0])
    bodies = [body for _, body in requests]
    assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
    assert len({b["messages"][0]["content"] for b in bodies}) == 1
    assert bodies[2]["messages"][:5] == bodies[1]["messages"] + [{"role": "assistant", "content": "Noted."}]
    assert all(8 <= b["max_tokens"] <= 16 and "tools" not in b for b in bodies)


def test_globex_system_prompts_differ_only_in_the_first_line() -> None:
    (_, first), (_, second) = play(sessions_of("globex")[0])
    a, b = first["messages"][0]["content"], second["messages"][0]["content"]
    assert a != b
    assert a.split("\n", 1)[1] == b.split("\n", 1)[1]
    assert a.startswith("Current time: 2026-11-29T12:00:01.123Z request ")
    assert len(a.split("\n", 1)[1].split()) > 300  # the long stable part that the header invalidates


def test_initech_tools_are_equal_sorted_but_differ_as_sent() -> None:
    bodies = [body for _, body in play(sessions_of("initech")[0])]
    assert 3 <= len(bodies) <= 4
    assert all(b["tool_choice"] == "none" for b in bodies)
    for prev, cur in zip(bodies, bodies[1:], strict=False):
        assert json.dumps(prev["tools"], sort_keys=True) == json.dumps(cur["tools"], sort_keys=True)
        assert json.dumps(prev["tools"]) != json.dumps(cur["tools"])
        # only inside `parameters`: vLLM re-serializes the outer levels, so only this order reaches the prompt
        assert (
            [list(t) for t in prev["tools"]] == [list(t) for t in cur["tools"]] == [["type", "function"]] * 4
        )
        assert [list(t["function"]) for t in cur["tools"]] == [["name", "description", "parameters"]] * 4
    # later calls append the assistant's tool call and the tool result to the previous call's messages
    second = bodies[1]["messages"]
    assert second[:2] == bodies[0]["messages"]
    assert second[2]["role"] == "assistant" and second[2]["tool_calls"][0]["type"] == "function"
    assert second[3]["role"] == "tool" and second[3]["tool_call_id"] == second[2]["tool_calls"][0]["id"]


def test_umbrella_sends_the_same_documents_in_another_order() -> None:
    (_, first), (_, second) = play(sessions_of("umbrella")[0])
    assert first["documents"] != second["documents"]
    canon = lambda docs: sorted(json.dumps(d) for d in docs)  # noqa: E731
    assert canon(first["documents"]) == canon(second["documents"])
    assert 4 <= len(first["documents"]) <= 6
    assert all(
        set(d) == {"title", "text"} and all(isinstance(v, str) for v in d.values())
        for d in first["documents"]
    )  # fmt: skip  (vLLM accepts only string values)


def test_hooli_truncates_history_to_the_last_two_messages_from_turn_three() -> None:
    bodies = [body for _, body in play(sessions_of("hooli")[0])]
    assert [len(b["messages"]) for b in bodies] == [2, 4, 4, 4]
    turn2, turn3 = bodies[1]["messages"], bodies[2]["messages"]
    assert turn3[1] == turn2[3]  # turn 2's user message now comes right after the system prompt
    assert turn3[1:3] != turn2[1:3]


def test_sessions_of_tenants_interleave() -> None:
    tenants = [s.tenant.name for s in iter_sessions(0, 1.0)]
    runs = sum(1 for a, b in zip(tenants, tenants[1:], strict=False) if a != b)
    assert runs > len(tenants) // 2


class FakeVllm:
    """A MockTransport handler answering like vLLM with --enable-prompt-tokens-details."""

    def __init__(self, stop_after: int | None = None, stop_event: threading.Event | None = None) -> None:
        self.requests: list[httpx.Request] = []
        self.lock = threading.Lock()
        self.stop_after, self.stop_event = stop_after, stop_event

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.requests.append(request)
            if self.stop_after and len(self.requests) >= self.stop_after and self.stop_event:
                self.stop_event.set()
        if request.headers["x-request-id"] == "hooli-c0-t2":
            return httpx.Response(503, text="overloaded")  # a failure: recorded, never raised
        usage = {"prompt_tokens": 100, "completion_tokens": 8,
                 "prompt_tokens_details": {"cached_tokens": 64}}  # fmt: skip
        return httpx.Response(
            200,
            json={
                "id": "chatcmpl-" + request.headers["x-request-id"],
                "usage": usage,
                "choices": [{"message": {"role": "assistant", "content": "ok"}}],
            },
        )


def test_run_workload_sends_every_planned_request_and_writes_labels(tmp_path: Path) -> None:
    fake = FakeVllm()
    labels_path = tmp_path / "labels.jsonl"
    labels = run_workload("http://gateway.test/", seed=5, scale=0.5, concurrency=3, labels_path=labels_path,
                          wait_scale=0.02, transport=httpx.MockTransport(fake), run_id="r5")  # fmt: skip
    planned = plan_labels(seed=5, scale=0.5)
    assert {lb["run_id"] for lb in labels} == {"r5"}
    sent = [datetime.fromisoformat(lb["ts"]) for lb in labels]
    assert all(lb["ts"].endswith("Z") and abs(t - datetime.now(UTC)) < timedelta(minutes=5) for lb, t in
               zip(labels, sent, strict=True))  # fmt: skip
    for lb in planned:
        if lb["tool_wait_ms"] is not None:
            lb["tool_wait_ms"] = round(lb["tool_wait_ms"] * 0.02)  # the waits actually made
    assert [{k: v for k, v in lb.items() if k not in OUTCOME_FIELDS} for lb in labels] == planned
    assert len(fake.requests) == len(planned)
    assert {str(r.url) for r in fake.requests} == {"http://gateway.test/v1/chat/completions"}
    assert sorted(json.loads(line)["request_id"] for line in labels_path.read_text().splitlines()) == \
        sorted(lb["request_id"] for lb in planned)  # fmt: skip
    failed = [lb for lb in labels if lb["status"] == "error"]
    assert [(lb["request_id"], lb["http_status"], lb["cached_tokens"]) for lb in failed] == [
        ("hooli-c0-t2", 503, None)]  # fmt: skip
    assert all(lb["cached_tokens"] == 64 and lb["prompt_tokens"] == 100 for lb in labels if lb not in failed)
    assert "hooli-c0-t3" in {lb["request_id"] for lb in labels}  # the session went on after the failure
    # a session's turns go out in order, sessions interleave
    order = [r.headers["x-request-id"] for r in fake.requests]
    for lb in planned:
        if lb["turn"] > 1:
            assert order.index(lb["request_id"]) > order.index(lb["request_id"][:-1] + str(lb["turn"] - 1))
    conversations = [r.headers["x-conversation-id"] for r in fake.requests]
    assert sum(1 for a, b in zip(conversations, conversations[1:], strict=False) if a != b) > len(
        {c for c in conversations})  # fmt: skip


def test_loop_runs_new_sessions_until_stopped() -> None:
    stop = threading.Event()
    fake = FakeVllm(stop_after=120, stop_event=stop)
    labels = run_workload("http://gateway.test", seed=1, scale=0.2, loop=True, stop_event=stop,
                          wait_scale=0.0, transport=httpx.MockTransport(fake))  # fmt: skip
    assert stop.is_set()
    assert 120 <= len(labels) < 130
    assert len({lb["request_id"] for lb in labels}) == len(labels)  # new rounds get new session indices


@pytest.mark.vllm
def test_pathologies_show_on_a_real_vllm_pod(vllm_fleet) -> None:  # type: ignore[no-untyped-def]
    """All requests to one pod (no gateway): the stable prefix hits, each pathology cuts the hit short.

    Seed 11 is this test's alone: a pod that already served the same prompts would hit them in full."""
    labels = run_workload(vllm_fleet.pods[0].base_url, seed=11, scale=0.2, concurrency=2, wait_scale=0.2,
                          id_prefix="realpod-")  # fmt: skip
    assert labels and all(lb["status"] == "ok" for lb in labels), labels
    by_id = {lb["request_id"]: lb for lb in labels}

    def prev(lb: dict) -> dict:
        return by_id[lb["request_id"][: -len(str(lb["turn"]))] + str(lb["turn"] - 1)]

    for lb in labels:
        if lb["tenant_id"] == "globex":
            assert lb["cached_tokens"] == 0, lb  # the header is in the first block
        elif lb["tenant_id"] == "stark":  # a volatile line mid-prompt: the lines before it are shared
            assert lb["turn"] == 1 or 0 < lb["cached_tokens"] < 700, lb
        elif lb["turn"] > 1:
            assert lb["cached_tokens"] >= 700, lb  # the ~800-token system prompt is shared
            if lb["pathology"] == "none":  # the previous turn's whole prompt is reused (full blocks)
                assert lb["cached_tokens"] >= prev(lb)["prompt_tokens"] - 32, lb
            else:  # reordered tools / documents, truncated history: the hit stops early
                assert lb["cached_tokens"] < prev(lb)["prompt_tokens"] - 64, lb
