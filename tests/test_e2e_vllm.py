"""End to end on real vLLM: two vLLM CPU servers, the reference gateway, a real Kafka-protocol broker (tansu),
the collector, the ingester into chDB, and the attribution job; then the store's numbers are checked against
numbers read straight from the servers and from the gateway's responses."""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

from demo.workload import _send, iter_sessions, run_workload
from gateway.proxy import GatewayServer, make_app
from ingest.attribution_job import run_attribution
from kvscope.config import build_config
from kvscope.pipeline import Pipeline
from tests.kill_harness import wait_until as wait_for
from tests.tcp_relay import TcpRelay

pytestmark = [pytest.mark.vllm, pytest.mark.broker]

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
RUNNING = "vllm:num_requests_running"  # a gauge: sent with every scrape


def read_counters(metrics_url: str) -> dict[str, float]:
    """Σ over engines of the prefix-cache counters, read straight from one server's /metrics."""
    body = httpx.get(metrics_url, timeout=10).text
    out = {HITS: 0.0, QUERIES: 0.0}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


@pytest.fixture(scope="module")
def e2e(vllm_fleet, tiny_model_dir, kafka_bootstrap, chdb_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Runs the whole pipeline once for the module and returns what the tests check."""
    from ingest.store import Store

    work = tmp_path_factory.mktemp("e2e")
    gw_log = work / "gateway.jsonl"
    pods = vllm_fleet.pods
    app = make_app([(p.name, p.base_url) for p in pods], gw_log, policy="round_robin",
                   tokenizer_path=Path(tiny_model_dir) / "tokenizer.json")
    ns = f"e2e{uuid.uuid4().hex[:8]}"
    cfg = replace(build_config({}, environ={}), kafka_bootstrap=kafka_bootstrap, topic_namespace=ns,
                  state_dir=str(work / "state"),
                  consumer_group=f"{ns}-ingest", database=f"e2e_{ns}", data_dir=str(chdb_dir),
                  vllm=",".join(f"{p.name}={p.base_url}" for p in pods), gateway_log=str(gw_log),
                  kv_events_endpoint=vllm_fleet.kv_events_endpoint, scrape_interval_seconds=1.0,
                  kv_events_replay=",".join(f"{p.kv_events_topic}={p.kv_replay_endpoint}" for p in pods),
                  attribution_interval_seconds=3600.0)
    store = Store.open(data_dir=chdb_dir, database=cfg.database)
    store.migrate()
    pipe = Pipeline(cfg, store=store)
    with GatewayServer(app) as gw:
        pipe.start()
        try:
            def scraped_all() -> bool:
                rows = store.query_rows(f"SELECT uniqExact(pod) FROM vllm_metrics WHERE name = '{RUNNING}'")
                return rows[0][0] == len(pods)
            wait_for(scraped_all, 60, "a first scrape of every pod")
            before = {p.name: read_counters(p.metrics_url) for p in pods}
            labels = run_workload(gw.url, seed=7, scale=0.5, concurrency=2, labels_path=work / "labels.jsonl",
                                  wait_scale=0.5)
            labels += turns_in_a_row(gw.url)
            edited = edited_turns(gw.url)
            unreplied = unreplied_turns(gw.url)
            skipped = prompt_logprobs_repeat(gw.url)
            subagents = parallel_subagents(gw.url)
            outage = failed_over_turns(pods, gw_log, Path(tiny_model_dir) / "tokenizer.json")
            prefilled = prefill_turns(gw.url)
            rewound = rewound_turns(gw.url)
            invisible = template_invisible_turns(gw.url)
            plain = plain_client_turns(gw.url)
            guarded = guardrail_turns(gw.url)
            rag = rag_template_turns(gw.url)
            one_message = one_message_repeat(gw.url)
            after = {p.name: read_counters(p.metrics_url) for p in pods}
            t_done = time.time()

            def scraped_after() -> bool:
                rows = store.query_rows(
                    f"SELECT pod, max(ts) FROM vllm_metrics WHERE name = '{RUNNING}' GROUP BY pod")
                return len(rows) == len(pods) and all(r[1].timestamp() > t_done + 0.5 for r in rows)
            wait_for(scraped_after, 60, "a scrape of every pod after the workload")
            n_lines = sum(1 for line in gw_log.read_text().splitlines() if line.strip())
            wait_for(lambda: store.query_rows("SELECT count() FROM gateway_requests")[0][0] == n_lines,
                     60, "every gateway log line in the store")
        finally:
            pipe.close()
    run_attribution(store, settle_seconds=0.0)
    records = [json.loads(line) for line in gw_log.read_text().splitlines() if line.strip()]
    yield {"store": store, "before": before, "after": after, "labels": labels, "records": records, "edited": edited,
           "unreplied": unreplied, "skipped": skipped, "subagents": subagents, "outage": outage,
           "prefilled": prefilled, "rewound": rewound, "invisible": invisible, "plain": plain, "guarded": guarded,
           "rag": rag, "one_message": one_message,
           "cfg": cfg, "pods": pods,
           "tokenizer": Path(tiny_model_dir) / "tokenizer.json"}


def turns_in_a_row(gateway_url: str) -> list[dict[str, Any]]:
    """Send the first two turns of one healthy chat session back to back, nothing else in flight, and return
    their labels (the workload's, with the outcome). Round robin over two pods then alternates, so the second
    turn lands on the other pod whatever order the concurrent workload left the gateway in: the concurrent
    workload alone moved no healthy second turn in some runs."""
    session = next(s for s in iter_sessions(seed=8, scale=0.5, id_prefix="in-a-row-")
                   if s.tenant.pathology == "none" and not s.is_agent and len(s.turns) >= 2)
    labels = []
    with httpx.Client(timeout=120) as client:
        for turn in (1, 2):
            label = session.label(turn)
            reply, outcome = _send(client, gateway_url, *session.request(turn, datetime.now().astimezone()))
            session.record_reply(turn, reply or "")
            labels.append(label | outcome)
    return labels


def edited_turns(gateway_url: str) -> tuple[str, str]:
    """Two turns of one conversation in which the client edited (redacted) the message its first turn sent, the
    second turn on the first turn's pod (round robin over two pods with nothing in flight: a request to the other
    pod between them). Returns the two request ids."""
    tag = uuid.uuid4().hex[:8]
    system = f"You are the archivist {tag}. " + " ".join(f"Rule {i}: file each record under its year." for i in
                                                          range(12))
    notes = " ".join(f"Note {i}: the shipment {i} left the depot on time." for i in range(30))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise these notes. " + notes}]
    headers = {"X-Conversation-Id": f"edit-{tag}", "X-Tenant-Id": "editor"}
    with httpx.Client(timeout=120) as client:
        r1 = client.post(f"{gateway_url}/v1/chat/completions", headers={**headers, "X-Request-Id": f"edit-{tag}-t1"},
                         json={"model": "tiny", "messages": first, "max_tokens": 8, "temperature": 0})
        assert r1.status_code == 200, r1.text
        reply = r1.json()["choices"][0]["message"]["content"] or "ok"
        other = client.post(f"{gateway_url}/v1/completions", headers={"X-Request-Id": f"edit-{tag}-other"},
                            json={"model": "tiny", "prompt": "filler", "max_tokens": 1})
        assert other.status_code == 200, other.text
        second = [first[0], {"role": "user", "content": "Summarise these notes. [REDACTED] " + notes},
                  {"role": "assistant", "content": reply}, {"role": "user", "content": "And in one line?"}]
        r2 = client.post(f"{gateway_url}/v1/chat/completions", headers={**headers, "X-Request-Id": f"edit-{tag}-t2"},
                         json={"model": "tiny", "messages": second, "max_tokens": 8, "temperature": 0})
        assert r2.status_code == 200, r2.text
    return f"edit-{tag}-t1", f"edit-{tag}-t2"


#: In :func:`post_in_order`: a 1-token completion with no ids, to move round robin on to the other pod.
FILLER = None


def post_in_order(gateway_url: str, headers: dict[str, str], sends: list[tuple[str, dict[str, Any] | None]]) -> None:
    """Send ``sends`` ((request id, chat body fields or :data:`FILLER`)) one after another, nothing else in flight,
    each chat request with ``headers`` (8 tokens at temperature 0 unless its fields say otherwise); every answer
    must be 200."""
    with httpx.Client(timeout=120) as client:
        for rid, fields in sends:
            if fields is FILLER:
                r = client.post(f"{gateway_url}/v1/completions", headers={"X-Request-Id": rid},
                                json={"model": "tiny", "prompt": "filler", "max_tokens": 1})
            else:
                r = client.post(f"{gateway_url}/v1/chat/completions", headers={**headers, "X-Request-Id": rid},
                                json={"model": "tiny", "max_tokens": 8, "temperature": 0, **fields})
            assert r.status_code == 200, r.text


def unreplied_turns(gateway_url: str) -> tuple[str, str]:
    """Two turns of one conversation, the second re-sending the first's messages and a new user message with no
    reply between (the user wrote again before the reply came), sent back to back with nothing else in flight so
    round robin puts the second on the other pod. Returns the two request ids."""
    tag = uuid.uuid4().hex[:8]
    system = f"You are the dispatcher {tag}. " + " ".join(f"Rule {i}: route each parcel by its zone." for i in
                                                            range(12))
    notes = " ".join(f"Parcel {i} waits at the depot for its van." for i in range(30))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Where is parcel 7?"},
             {"role": "assistant", "content": "At the depot."}, {"role": "user", "content": "List them. " + notes}]
    headers = {"X-Conversation-Id": f"unreplied-{tag}", "X-Tenant-Id": "dispatch"}
    ids = (f"unreplied-{tag}-t1", f"unreplied-{tag}-t2")
    post_in_order(gateway_url, headers, [(ids[0], {"messages": first}),
                                         (ids[1], {"messages": [*first, {"role": "user", "content": "Hello?"}]})])
    return ids


def prompt_logprobs_repeat(gateway_url: str) -> tuple[str, str]:
    """A chat request, then the same one asking for prompt logprobs on the same pod (round robin over two pods
    with a filler between). vLLM reads no prefix cache for the second. Returns the two request ids."""
    tag = uuid.uuid4().hex[:8]
    system = f"You are the scorer {tag}. " + " ".join(f"Rule {i}: score each answer from 0 to 9." for i in range(12))
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Score: the van left at nine."}], "max_tokens": 2}
    ids = (f"plp-{tag}-t1", f"plp-{tag}-t2")
    post_in_order(gateway_url, {"X-Tenant-Id": "scorer"},
                  [(ids[0], body), (f"plp-{tag}-other", FILLER), (ids[1], {**body, "prompt_logprobs": 1})])
    return ids


def test_a_request_that_read_no_prefix_cache_is_no_cache_query(e2e) -> None:  # type: ignore[no-untyped-def]
    """The repeat asked for prompt logprobs, so vLLM read no prefix cache although the prompt sat on that pod: the
    gateway logs skip_reading_prefix_cache, the store keeps its cached count as not reported (vLLM counted it in
    no prefix-cache query: the hit rates test above agrees to the token because of it), and its prompt tokens
    are `not_reported / skip_reading_prefix_cache`, not `evicted` on a pod that evicted nothing."""
    t1, t2 = e2e["skipped"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[t1]["pod"] == by_id[t2]["pod"], "round robin moved the repeat: the control needs one pod"
    assert (by_id[t1]["skip_reading_prefix_cache"], by_id[t2]["skip_reading_prefix_cache"]) == (False, True)
    assert by_id[t2]["cached_tokens"] == 0  # what vLLM reports for it
    store = e2e["store"]
    assert store.query_rows("SELECT cached_tokens FROM gateway_requests WHERE request_id = {r:String}",
                            {"r": t2}) == [(None,)]
    rows = store.query_rows(
        "SELECT cause, sub_cause, tokens FROM miss_attribution WHERE request_id = {r:String}", {"r": t2})
    print(f"\nprompt-logprobs repeat: prompt {by_id[t2]['prompt_tokens']}, causes {rows}")
    assert rows == [("not_reported", "skip_reading_prefix_cache", by_id[t2]["prompt_tokens"])]


def only_causes(e2e: dict[str, Any], rid: str, label: str, named: tuple[str, str]) -> None:
    """Request ``rid``'s causes (printed under ``label``) include ``named`` and are otherwise only `unavoidable`;
    they sum to its missed tokens."""
    rec = {r["request_id"]: r for r in e2e["records"]}[rid]
    rows = e2e["store"].query_rows(
        "SELECT cause, sub_cause, tokens FROM miss_attribution WHERE request_id = {r:String}", {"r": rid})
    print(f"\n{label}: prompt {rec['prompt_tokens']}, cached {rec['cached_tokens']}, causes {rows}")
    causes = {(c, s) for c, s, _ in rows}
    assert named in causes
    assert causes <= {named, ("unavoidable", "")}, rows
    assert sum(t for *_, t in rows) == rec["prompt_tokens"] - rec["cached_tokens"]


def parallel_subagents(gateway_url: str) -> tuple[str, str, str]:
    """Two sub-agents of one agent run (same system prompt, tasks A and B): A1, B1, a filler, then A2 (task A, the
    tool call A1's reply asked for, its result), back to back so round robin puts A1 and B1 on different pods
    and A2 on B1's. Returns the ids of A1, B1, A2."""
    tag = uuid.uuid4().hex[:8]
    system = f"You are an explore sub-agent {tag}. " + " ".join(f"Rule {i}: read each file before you grep it."
                                                                 for i in range(12))
    task = {t: f"Task {t}: " + " ".join(f"Check module {t}{i} for unused imports." for i in range(30))
            for t in "AB"}
    call = {"id": f"call-{tag}", "type": "function", "function": {"name": "grep", "arguments": "{}"}}
    a2 = [{"role": "system", "content": system}, {"role": "user", "content": task["A"]},
          {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": call["id"], "content": "found 3 unused imports"}]
    headers = {"X-Agent-Run-Id": f"run-{tag}", "X-Tenant-Id": "explorer"}
    ids = (f"sub-{tag}-a1", f"sub-{tag}-b1", f"sub-{tag}-a2")
    post_in_order(gateway_url, headers, [(ids[0], {"messages": a2[:2]}),
                                         (ids[1], {"messages": [a2[0], {"role": "user", "content": task["B"]}]}),
                                         (f"sub-{tag}-other", FILLER), (ids[2], {"messages": a2})])
    return ids


def prefill_turns(gateway_url: str) -> tuple[str, str]:
    """Two turns of one conversation, back to back with nothing else in flight (round robin puts the second on the
    other pod): the first ends with a partial assistant message that vLLM continues (continue_final_message), the
    second carries it completed (prefill + reply as one assistant message) and a new question. Returns the ids."""
    tag = uuid.uuid4().hex[:8]
    system = f"You are the harbour clerk {tag}. " + " ".join(f"Rule {i}: note each ship by its flag." for i in
                                                              range(12))
    notes = " ".join(f"Ship {i} docked at berth {i % 5}." for i in range(30))
    prefill = "Here is the berth list:"
    first = [{"role": "system", "content": system}, {"role": "user", "content": "List the berths. " + notes},
             {"role": "assistant", "content": prefill}]
    headers = {"X-Conversation-Id": f"prefill-{tag}", "X-Tenant-Id": "harbour"}
    ids = (f"prefill-{tag}-t1", f"prefill-{tag}-t2")
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        r1 = client.post(f"{gateway_url}/v1/chat/completions", headers={**headers, "X-Request-Id": ids[0]},
                         json={**body, "messages": first, "continue_final_message": True,
                               "add_generation_prompt": False})
        assert r1.status_code == 200, r1.text
        completed = prefill + (r1.json()["choices"][0]["message"]["content"] or "")
        second = [*first[:2], {"role": "assistant", "content": completed},
                  {"role": "user", "content": "Which is free?"}]
        r2 = client.post(f"{gateway_url}/v1/chat/completions", headers={**headers, "X-Request-Id": ids[1]},
                         json={**body, "messages": second})
        assert r2.status_code == 200, r2.text
    return ids


def test_an_assistant_prefill_the_reply_completed_is_not_a_truncated_history(e2e) -> None:  # type: ignore[no-untyped-def]
    """The first turn was an assistant prefill vLLM continued; the second carries it completed, on the other pod.
    The first turn's whole prompt was reusable there: `routed_away` (its prefill_history_hash is the first turn's
    history), never `prefix_drift / history_truncated`, which the other previous-turn hashes read."""
    t1, t2 = e2e["prefilled"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[t1]["pod"] != by_id[t2]["pod"], "round robin kept the second turn on its pod"
    assert by_id[t1]["continue_final_message"] is True and by_id[t2]["continue_final_message"] is False
    assert by_id[t2]["prefill_history_hash"] == by_id[t1]["history_prefix_hash"] != ""
    only_causes(e2e, t2, f"prefill turn (first turn {by_id[t1]['prompt_tokens']})", ("routed_away", ""))


def rewound_turns(gateway_url: str) -> tuple[str, str, str, str]:
    """Three turns of one conversation on one pod, then the second re-sent as it was (a chat UI's regenerate of an
    earlier reply) on the other pod: round robin over two pods, a filler between the turns. Returns the four ids."""
    tag = uuid.uuid4().hex[:8]
    system = {"role": "system", "content": f"You are the librarian {tag}. " + " ".join(
        f"Rule {i}: shelve each book by its author." for i in range(12))}
    u1 = {"role": "user", "content": "Catalogue these. " + " ".join(f"Book {i} is on shelf {i % 7}." for i in
                                                                    range(30))}
    a1, u2 = {"role": "assistant", "content": "Catalogued."}, {"role": "user", "content": "Where is book 12?"}
    a2, u3 = {"role": "assistant", "content": "Shelf 5."}, {"role": "user", "content": "And book 13?"}
    headers = {"X-Conversation-Id": f"rewind-{tag}", "X-Tenant-Id": "library"}
    ids = (f"rewind-{tag}-t1", f"rewind-{tag}-t2", f"rewind-{tag}-t3", f"rewind-{tag}-t2-again")
    post_in_order(gateway_url, headers, [
        (ids[0], {"messages": [system, u1]}), (f"rewind-{tag}-f1", FILLER),
        (ids[1], {"messages": [system, u1, a1, u2]}), (f"rewind-{tag}-f2", FILLER),
        (ids[2], {"messages": [system, u1, a1, u2, a2, u3]}), (ids[3], {"messages": [system, u1, a1, u2]})])
    return ids


def test_going_back_a_turn_is_not_a_truncated_history(e2e) -> None:  # type: ignore[no-untyped-def]
    """Turn 2 re-sent after turn 3, on the other pod: its whole prompt was in turn 3's blocks on the first pod, so
    all its full blocks but the last token's are `routed_away` (the conversation's latest turn, turn 3, is its
    previous turn; its history is turn 3's prev_history_hash), never `prefix_drift / history_truncated`."""
    ids = e2e["rewound"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert len({by_id[i]["pod"] for i in ids[:3]}) == 1 and by_id[ids[3]]["pod"] != by_id[ids[0]]["pod"]
    assert by_id[ids[3]]["history_prefix_hash"] == by_id[ids[2]]["prev_history_hash"] != ""
    only_causes(e2e, ids[3], "turn 2 re-sent after turn 3", ("routed_away", ""))
    rows = e2e["store"].query_rows("SELECT predecessor_request_id, tokens FROM miss_attribution WHERE request_id = "
                                   "{r:String} AND cause = 'routed_away'", {"r": ids[3]})
    block = e2e["store"].query_rows("SELECT any(block_size) FROM request_attribution WHERE request_id = {r:String}",
                                    {"r": ids[3]})[0][0]
    prompt = by_id[ids[3]]["prompt_tokens"]
    assert rows == [(ids[2], (prompt - 1) // block * block)]


def template_invisible_turns(gateway_url: str) -> tuple[str, str, str, str, str]:
    """Two kinds the segment hashes read as a drift the tokens do not hold (found on real pods by a hostile hunt),
    each request back to back so round robin alternates the pods:
    - two requests whose one-line system prompt ends in the time of the request, the second on the other pod;
    - an agent run: T1, T2 (an assistant tool call with ``content: null``, its result) on the other pod, T3 back on
      T1's pod re-sending that tool call with ``content: ""``, which the template prints the same.
    Returns the ids (the two timed requests, T1, T2, T3)."""
    tag = uuid.uuid4().hex[:8]
    policy = f"You are the support bot {tag} for Acme. " + " ".join(
        f"Policy {i}: refunds of item {i} take {i} days." for i in range(20))
    timed = (f"timed-{tag}-1", f"timed-{tag}-2")
    post_in_order(gateway_url, {"X-Tenant-Id": "timed"}, [
        (rid, {"messages": [{"role": "system", "content": f"{policy} Current time: 2026-12-07 02:1{i}:05."},
                            {"role": "user", "content": "Refund for item 3?"}]}) for i, rid in enumerate(timed)])
    system = {"role": "system", "content": f"You are the build agent {tag}. " + " ".join(
        f"Rule {i}: run the tests before each commit." for i in range(12))}
    task = {"role": "user", "content": "Task: " + " ".join(f"Fix warning {i} in crate {i % 4}." for i in range(20))}
    call = {"id": f"call_{tag}", "type": "function", "function": {"name": "grep", "arguments": "{\"q\": \"w\"}"}}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "result: " + " ".join(
        f"file {i} has warning {i}." for i in range(15))}
    turns = (f"tool-{tag}-t1", f"tool-{tag}-t2", f"tool-{tag}-t3")
    post_in_order(gateway_url, {"X-Agent-Run-Id": f"tool-{tag}", "X-Tenant-Id": "builder"}, [
        (turns[0], {"messages": [system, task]}),
        (turns[1], {"messages": [system, task, {"role": "assistant", "content": None, "tool_calls": [call]}, result]}),
        (turns[2], {"messages": [system, task, {"role": "assistant", "content": "", "tool_calls": [call]}, result,
                                 {"role": "assistant", "content": "Found them."},
                                 {"role": "user", "content": "Now fix them."}]})])
    return (*timed, *turns)


def plain_client_turns(gateway_url: str) -> tuple[str, str, str, str]:
    """Three users of one app (one system prompt) from a client that sends no conversation or run id, back to back
    so round robin alternates the pods: user A's first turn (pod X), user B's and user C's first turns (pods Y, X),
    then A's second turn (pod Y). Returns the ids (A1, B1, C1, A2)."""
    tag = uuid.uuid4().hex[:8]
    system = {"role": "system", "content": f"You are the travel desk {tag}. " + " ".join(
        f"Rule {i}: quote fares in euros and name the carrier." for i in range(12))}
    ask = {"role": "user", "content": "Plan my trip. " + " ".join(
        f"Leg {i}: from city {i} to city {i + 1} on day {i}." for i in range(20))}
    ids = (f"plain-{tag}-a1", f"plain-{tag}-b1", f"plain-{tag}-c1", f"plain-{tag}-a2")
    post_in_order(gateway_url, {"X-Tenant-Id": "plain"}, [
        (ids[0], {"messages": [system, ask]}),
        (ids[1], {"messages": [system, {"role": "user", "content": "Cheapest fare to Lisbon?"}]}),
        (ids[2], {"messages": [system, {"role": "user", "content": "Is there a night train to Vienna?"}]}),
        (ids[3], {"messages": [system, ask, {"role": "assistant", "content": "Here is your plan."},
                               {"role": "user", "content": "Make leg 3 a train."}]})])
    return ids


def test_a_client_without_ids_finds_its_previous_turn(e2e) -> None:  # type: ignore[no-untyped-def]
    """A plain OpenAI client (no conversation id): A's second turn went to the other pod. Its previous turn is A's
    first (found by its messages, key 12), not C's request, the latest with the same system prompt: A1's whole
    prompt in full blocks, less what A2's pod held (the system prompt, from B1), is `routed_away`. Before, A2 took C1
    and read its history as new: all `unavoidable`."""
    a1, b1, c1, a2 = e2e["plain"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[a1]["pod"] == by_id[c1]["pod"] != by_id[a2]["pod"] == by_id[b1]["pod"]
    assert_previous_turn_routed_away(e2e, a2, a1)


def assert_previous_turn_routed_away(e2e: dict[str, Any], request: str, previous: str) -> dict[tuple[str, str], int]:
    """``request``'s stored answer names ``previous`` as its previous turn, accounts for every missed token, and puts
    ``previous``'s whole prompt in full blocks, less what ``request``'s pod held, under `routed_away` (within one
    block: the previous prompt's last block may hold the generation prompt's tokens, which the next one continues
    otherwise). Returns its (cause, sub_cause) → tokens."""
    by_id = {r["request_id"]: r for r in e2e["records"]}
    pred = e2e["store"].query_rows("SELECT predecessor_request_id, predecessor_kind FROM request_attribution FINAL "
                                   "WHERE request_id = {r:String}", {"r": request})
    rows = stored_causes(e2e, request)
    block, reusable = reusable_blocks(by_id, request, previous)
    print(f"\n{request}: prompt {by_id[request]['prompt_tokens']}, cached {by_id[request]['cached_tokens']}, "
          f"previous prompt {by_id[previous]['prompt_tokens']}, predecessor {pred}, causes {rows}")
    assert pred == [(previous, "previous_turn")]
    assert sum(rows.values()) == by_id[request]["prompt_tokens"] - by_id[request]["cached_tokens"]
    assert reusable > block and abs(rows.get(("routed_away", ""), 0) - reusable) <= block, rows
    return rows


def stored_causes(e2e: dict[str, Any], request: str) -> dict[tuple[str, str], int]:
    """``request``'s stored answer: (cause, sub_cause) → tokens."""
    return dict(((c, sc), t) for c, sc, t in e2e["store"].query_rows(
        "SELECT cause, sub_cause, tokens FROM miss_attribution WHERE request_id = {r:String}", {"r": request}))


def reusable_blocks(by_id: dict[str, dict[str, Any]], request: str, previous: str) -> tuple[int, int]:
    """(block size, tokens of ``previous``'s prompt in full blocks (its last token left out) less what ``request``'s
    pod held): what ``request`` could have reused of ``previous``."""
    block = by_id[request]["prompt_block_size"] or 32
    return block, (by_id[previous]["prompt_tokens"] - 1) // block * block - by_id[request]["cached_tokens"]


def guardrail_turns(gateway_url: str) -> tuple[str, str, str, str]:
    """A chat whose every turn is followed by a guardrail call on the same messages and conversation id under a
    system prompt of its own, back to back so round robin alternates the pods: turn 1 (pod X), guardrail 1 (pod Y),
    a filler (pod X), turn 2 (pod Y, which holds only guardrail 1), guardrail 2 (pod X). Returns (t1, g1, t2, g2)."""
    tag = uuid.uuid4().hex[:8]
    chat = {"role": "system", "content": f"You are the library desk {tag}. " + " ".join(
        f"Rule {i}: give the shelf and the loan period." for i in range(12))}
    guard = {"role": "system", "content": f"Classify {tag} as SAFE or UNSAFE. " + " ".join(
        f"Check {i}: flag requests for other readers' data." for i in range(12))}
    ask = {"role": "user", "content": "Find me books. " + " ".join(
        f"Topic {i}: the history of printing in city {i}." for i in range(20))}
    turn2 = [ask, {"role": "assistant", "content": "Here are the shelves."},
             {"role": "user", "content": "Which can I borrow for a month?"}]
    ids = tuple(f"guard-{tag}-{n}" for n in ("t1", "g1", "filler", "t2", "g2"))
    post_in_order(gateway_url, {"X-Tenant-Id": "library", "X-Conversation-Id": f"guarded-{tag}"}, [
        (ids[0], {"messages": [chat, ask]}), (ids[1], {"messages": [guard, ask]}), (ids[2], FILLER),
        (ids[3], {"messages": [chat, *turn2]}), (ids[4], {"messages": [guard, *turn2]})])
    return ids[0], ids[1], ids[3], ids[4]


def test_a_guardrail_call_on_the_chat_id_is_not_the_previous_turn(e2e) -> None:  # type: ignore[no-untyped-def]
    """Each chat turn is followed by a guardrail call on the same messages and conversation id under its own system
    prompt. Turn 2 went to the guardrail's pod: its previous turn is turn 1 (its thread's latest under its system
    prompt), and turn 1's full blocks are `routed_away`; guardrail 2's is guardrail 1, on the other pod.
    Before keys 17/18 turn 2 took guardrail 1 (the conversation's latest) and read `prefix_drift / system_changed`."""
    t1, g1, t2, g2 = e2e["guarded"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[t1]["pod"] == by_id[g2]["pod"] != by_id[g1]["pod"] == by_id[t2]["pod"]
    for request, previous in ((t2, t1), (g2, g1)):
        rows = assert_previous_turn_routed_away(e2e, request, previous)
        assert not any(c == "prefix_drift" for c, _ in rows), rows


def rag_template_turns(gateway_url: str) -> tuple[str, str]:
    """LlamaIndex's default text-QA template (nodes joined by blank lines, rule lines around the context, the query
    after single newlines) in the user message, back to back so round robin alternates the pods: r1 (pod X) with
    four nodes, r2 (pod Y) with the same nodes reordered and another query. Returns (r1, r2)."""
    tag = uuid.uuid4().hex[:8]
    system = {"role": "system", "content": f"You are the archive assistant {tag}. Answer from the context only."}
    nodes = {n: " ".join(f"{n} record {i}: the {n.lower()} vault keeps {i} copies in region {i}." for i in range(8))
             for n in ("Alpha", "Beta", "Gamma", "Delta")}

    def message(order: list[str], query: str) -> dict[str, str]:
        context = "\n\n".join(nodes[n] for n in order)
        return {"role": "user", "content": "Context information is below.\n---------------------\n" + context
                + "\n---------------------\nGiven the context information and not prior knowledge, answer the "
                f"query.\nQuery: {query}\nAnswer: "}
    ids = (f"rag-{tag}-r1", f"rag-{tag}-r2")
    post_in_order(gateway_url, {"X-Tenant-Id": "archive"}, [
        (ids[0], {"messages": [system, message(["Alpha", "Beta", "Gamma", "Delta"], "Where is Beta kept?")]}),
        (ids[1], {"messages": [system, message(["Gamma", "Alpha", "Delta", "Beta"], "How many Delta copies?")]})])
    return ids


def test_reordered_nodes_of_a_llamaindex_template_read_rag_reordered(e2e) -> None:  # type: ignore[no-untyped-def]
    """r2 sent r1's nodes reordered, on the other pod: the nodes read `prefix_drift / rag_reordered` and only the
    query and the template's tail stay `unavoidable`. Before, the template's rule lines glued its header to the
    first node and the last node to the query, so the reorder read `unavoidable` from the header on."""
    r1, r2 = e2e["rag"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[r1]["pod"] != by_id[r2]["pod"]
    rows = stored_causes(e2e, r2)
    missed = by_id[r2]["prompt_tokens"] - by_id[r2]["cached_tokens"]
    print(f"\n{r2}: prompt {by_id[r2]['prompt_tokens']}, cached {by_id[r2]['cached_tokens']}, causes {rows}")
    assert sum(rows.values()) == missed
    assert rows.get(("prefix_drift", "rag_reordered"), 0) >= missed * 3 // 4, rows
    assert rows.get(("unavoidable", ""), 0) <= missed // 8, rows


def one_message_repeat(gateway_url: str) -> tuple[str, str]:
    """A batch script's prompt with nothing before the user message (no system prompt, no ids), sent twice back to
    back: round robin puts the second on the other pod. Returns the ids."""
    tag = uuid.uuid4().hex[:8]
    ask = {"role": "user", "content": f"Label {tag}: classify the review below as positive or negative. " + " ".join(
        f"Rule {i}: a review that mentions a refund is negative." for i in range(16)) + "\n\nReview: great value."}
    ids = (f"one-{tag}-1", f"one-{tag}-2")
    post_in_order(gateway_url, {"X-Tenant-Id": "batch"}, [(ids[0], {"messages": [ask]}), (ids[1], {"messages": [ask]})])
    return ids


def test_the_same_one_message_prompt_again_is_routed_away(e2e) -> None:  # type: ignore[no-untyped-def]
    """The second send went to the other pod: its predecessor is the first (the same prompt, key 3 on the message)
    and the first's full blocks are `routed_away`. Before, a prompt with nothing before its user message had no
    predecessor key: all `unavoidable`."""
    first, second = e2e["one_message"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[first]["pod"] != by_id[second]["pod"]
    assert e2e["store"].query_rows("SELECT predecessor_request_id, predecessor_kind FROM request_attribution FINAL "
                                   "WHERE request_id = {r:String}", {"r": second}) == [(first, "fingerprint")]
    rows = stored_causes(e2e, second)
    block, reusable = reusable_blocks(by_id, second, first)
    print(f"\n{second}: prompt {by_id[second]['prompt_tokens']}, cached {by_id[second]['cached_tokens']}, "
          f"causes {rows}")
    assert sum(rows.values()) == by_id[second]["prompt_tokens"] - by_id[second]["cached_tokens"]
    assert reusable > block and rows.get(("routed_away", ""), 0) == reusable, rows


def chain_common(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How many leading block hashes two logged requests' chains share."""
    k = 0
    for x, y in zip(a["prompt_block_hashes"], b["prompt_block_hashes"], strict=False):
        if x != y:
            break
        k += 1
    return k


def test_a_drift_the_tokens_do_not_hold_is_bounded_by_the_block_chains(e2e) -> None:  # type: ignore[no-untyped-def]
    """The gateway's block chains (the token ids vLLM renders, from its /tokenize) say how far two prompts are equal.
    The timed request on the other pod: `routed_away` for the blocks before the one holding the time,
    `prefix_drift / volatile_system` from there, not from the system prompt's first token. T3: its tokens repeat T2's
    whole prompt (the template prints null and "" alike), so no drift: `routed_away` for T2's blocks that T1's pod
    did not hold."""
    r1, r2, t1, t2, t3 = e2e["invisible"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[r1]["pod"] != by_id[r2]["pod"] and by_id[t1]["pod"] == by_id[t3]["pod"] != by_id[t2]["pod"]
    assert by_id[r2]["prompt_block_hashes"] and by_id[t3]["prompt_block_hashes"], "the gateway logged no chain"
    store = e2e["store"]

    def causes(rid: str) -> dict[tuple[str, str], int]:
        rows = store.query_rows("SELECT cause, sub_cause, tokens FROM miss_attribution WHERE request_id = {r:String}",
                                {"r": rid})
        print(f"\n{rid}: prompt {by_id[rid]['prompt_tokens']}, cached {by_id[rid]['cached_tokens']}, causes {rows}")
        assert sum(t for *_, t in rows) == by_id[rid]["prompt_tokens"] - by_id[rid]["cached_tokens"]
        return {(c, sc): t for c, sc, t in rows}

    block = by_id[r2]["prompt_block_size"]
    equal = chain_common(by_id[r2], by_id[r1]) * block
    got = causes(r2)
    assert 0 < equal < by_id[r1]["system_tokens"]
    assert got[("routed_away", "")] == equal - by_id[r2]["cached_tokens"]
    assert set(got) == {("routed_away", ""), ("prefix_drift", "volatile_system"), ("unavoidable", "")}
    assert chain_common(by_id[t3], by_id[t2]) == len(by_id[t2]["prompt_block_hashes"])  # T2's blocks, all in T3
    got = causes(t3)
    assert got.pop(("routed_away", "")) == len(by_id[t2]["prompt_block_hashes"]) * block - by_id[t3]["cached_tokens"]
    assert set(got) <= {("unavoidable", "")}


def failed_over_turns(pods: list[Any], gw_log: Path, tokenizer: Path) -> tuple[str, str]:
    """Two turns of one conversation through a second gateway (prefix affinity, writing the same log) that reaches
    the first pod through a :class:`TcpRelay`: the first turn lands there, then the relay goes down (the pod looks
    dead: its port refuses connections) and the second turn, pinned to it, fails over to the other pod. Returns
    the two request ids."""
    tag = uuid.uuid4().hex[:8]
    system = f"You are the night operator {tag}. " + " ".join(f"Rule {i}: log each alarm with its time."
                                                              for i in range(12))
    notes = " ".join(f"Alarm {i} rang at the north gate." for i in range(30))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the alarms. " + notes}]
    headers = {"X-Conversation-Id": f"outage-{tag}", "X-Tenant-Id": "nightshift"}
    ids = (f"outage-{tag}-t1", f"outage-{tag}-t2")
    host, port = httpx.URL(pods[0].base_url).host, httpx.URL(pods[0].base_url).port
    with TcpRelay((host, port)) as relay:
        app = make_app([(pods[0].name, relay.url), (pods[1].name, pods[1].base_url)], gw_log,
                       policy="prefix_affinity", tokenizer_path=tokenizer)
        with GatewayServer(app) as gw, httpx.Client(timeout=120) as client:
            body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
            r1 = client.post(f"{gw.url}/v1/chat/completions", headers={**headers, "X-Request-Id": ids[0]},
                             json={**body, "messages": first})
            assert r1.status_code == 200, r1.text
            reply = r1.json()["choices"][0]["message"]["content"] or "ok"
            relay.down()
            time.sleep(5)  # past the gateway's keep-alive: no pooled connection to the dead pod is left
            second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Which gate?"}]
            r2 = client.post(f"{gw.url}/v1/chat/completions", headers={**headers, "X-Request-Id": ids[1]},
                             json={**body, "messages": second})
            assert r2.status_code == 200, r2.text
    return ids


def test_a_turn_failed_over_from_a_dead_pod_is_pod_down(e2e) -> None:  # type: ignore[no-untyped-def]
    """The pod that held the conversation refused the second turn's connection, so the gateway sent it to the other
    pod (routing_reason pod_down) and logged the dead pod in pods_down: the first turn's prompt, reusable on the
    dead pod only, is `routed_away / pod_down` (an outage, not the router), the rest `unavoidable`."""
    t1, t2 = e2e["outage"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    dead = by_id[t1]["pod"]
    assert by_id[t2]["pod"] != dead and by_id[t2]["routing_reason"] == "pod_down"
    assert by_id[t2]["pods_down"] == [dead] and by_id[t1]["pods_down"] == []
    assert e2e["store"].query_rows("SELECT predecessor_request_id, predecessor_pod FROM request_attribution FINAL "
                                   "WHERE request_id = {r:String}", {"r": t2}) == [(t1, dead)]
    only_causes(e2e, t2, f"failed-over turn (first turn {by_id[t1]['prompt_tokens']})", ("routed_away", "pod_down"))


def test_parallel_subagents_each_continue_their_own_thread(e2e) -> None:  # type: ignore[no-untyped-def]
    """A2 ran on B1's pod, which held only the shared system prompt: its previous turn is A1 (same run, same first
    message), whose prompt sat on the other pod: `routed_away`, never `prefix_drift / history_changed`, which taking
    the run's latest request (B1, another thread) as the previous turn reads."""
    a1, b1, a2 = e2e["subagents"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[a2]["pod"] == by_id[b1]["pod"] != by_id[a1]["pod"], "round robin did not alternate"
    assert by_id[a2]["first_message_hash"] == by_id[a1]["first_message_hash"] != by_id[b1]["first_message_hash"]
    store = e2e["store"]
    assert store.query_rows("SELECT predecessor_request_id, predecessor_kind FROM request_attribution FINAL "
                            "WHERE request_id = {r:String}", {"r": a2}) == [(a1, "previous_turn")]
    only_causes(e2e, a2, f"sub-agent turn (A1 {by_id[a1]['prompt_tokens']})", ("routed_away", ""))


def test_a_message_sent_before_the_reply_is_not_a_truncated_history(e2e) -> None:  # type: ignore[no-untyped-def]
    """The second turn re-sent the first's messages and added one with no reply between, and round robin put it
    on the other pod. The first turn's whole prompt was reusable on its pod: `routed_away` (the first turn's
    next_history_hash is the second's history), never `prefix_drift / history_truncated`, which
    prev_history_hash alone reads (it assumes a reply between the turns)."""
    t1, t2 = e2e["unreplied"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[t1]["pod"] != by_id[t2]["pod"], "round robin kept the second turn on its pod"
    assert by_id[t2]["history_prefix_hash"] == by_id[t1]["next_history_hash"] != ""
    assert by_id[t2]["prev_history_hash"] != by_id[t1]["history_prefix_hash"]
    only_causes(e2e, t2, f"unreplied turn (first turn {by_id[t1]['prompt_tokens']})", ("routed_away", ""))


def test_an_edited_previous_message_is_drift_not_eviction(e2e) -> None:  # type: ignore[no-untyped-def]
    """The client redacted the message its previous turn sent; the turn stayed on its pod, which evicted nothing.
    vLLM hit the prefix up to the edit; the rest of what the previous turn held is `prefix_drift /
    history_changed` (the gateway's prev_suffix_hash is not the first turn's suffix_hash), never `evicted` or
    `cold`, and the causes sum to the missed tokens."""
    t1, t2 = e2e["edited"]
    by_id = {r["request_id"]: r for r in e2e["records"]}
    assert by_id[t1]["pod"] == by_id[t2]["pod"], "round robin moved the edited turn: the control needs one pod"
    assert by_id[t2]["prev_suffix_hash"] not in ("", by_id[t1]["suffix_hash"])
    assert by_id[t2]["prev_history_hash"] == by_id[t1]["history_prefix_hash"]
    only_causes(e2e, t2, "edited turn", ("prefix_drift", "history_changed"))


def test_every_request_succeeded_and_was_logged(e2e) -> None:  # type: ignore[no-untyped-def]
    ok = [lab for lab in e2e["labels"] if lab["status"] == "ok"]
    assert len(ok) == len(e2e["labels"]) > 20
    logged = {r["request_id"] for r in e2e["records"]}
    assert {lab["request_id"] for lab in ok} <= logged


def test_hit_rate_matches_vllm_counters_and_gateway(e2e) -> None:  # type: ignore[no-untyped-def]
    store = e2e["store"]
    d_hits = sum(e2e["after"][p][HITS] - e2e["before"][p][HITS] for p in e2e["after"])
    d_queries = sum(e2e["after"][p][QUERIES] - e2e["before"][p][QUERIES] for p in e2e["after"])
    direct_vllm = d_hits / d_queries
    # vLLM counts a request that read no prefix cache (prompt logprobs) in no query: nor does the hit rate
    gw = [r for r in e2e["records"] if not r.get("skip_reading_prefix_cache")]
    assert len(gw) < len(e2e["records"])  # the prompt-logprobs repeat is in the run
    direct_gateway = sum(r["cached_tokens"] for r in gw) / sum(r["prompt_tokens"] for r in gw)
    df = store.named("hit_rate_total")
    by_source = {row["source"]: row for row in df.iter_rows(named=True)}
    print(f"\nE2E hit rates: vLLM direct {direct_vllm:.4f} ({d_hits:.0f}/{d_queries:.0f}), "
          f"gateway direct {direct_gateway:.4f}, store vllm {by_source['vllm']['token_weighted_hit_rate']:.4f} "
          f"({by_source['vllm']['hit_tokens']}/{by_source['vllm']['query_tokens']}), "
          f"store gateway {by_source['gateway']['token_weighted_hit_rate']:.4f} "
          f"({by_source['gateway']['hit_tokens']}/{by_source['gateway']['query_tokens']})")
    assert d_queries > 10_000
    # Exact token counts, not only ratios: the store's counter deltas between its first scrape (before the
    # workload, on an idle fleet) and its last (after) are the servers' own before/after difference.
    assert (by_source["vllm"]["hit_tokens"], by_source["vllm"]["query_tokens"]) == (round(d_hits), round(d_queries))
    assert (by_source["gateway"]["hit_tokens"], by_source["gateway"]["query_tokens"]) == (
        sum(r["cached_tokens"] for r in gw), sum(r["prompt_tokens"] for r in gw))
    # The two sources measure the same tokens here (no other clients), so they agree exactly too.
    direct = (sum(r["cached_tokens"] for r in gw), sum(r["prompt_tokens"] for r in gw))
    assert (round(d_hits), round(d_queries)) == direct


def test_timestamp_first_tenant_is_volatile_system(e2e) -> None:  # type: ignore[no-untyped-def]
    store = e2e["store"]
    # globex: the timestamp line first (stark's unknown-form line sits mid-prompt: its lines before it are shared)
    ids = [lab["request_id"] for lab in e2e["labels"] if lab["tenant_id"] == "globex"]
    assert len(ids) >= 3
    rows = store.query_rows(
        "SELECT cause, sub_cause, sum(tokens) FROM miss_attribution WHERE request_id IN {ids:Array(String)} "
        "GROUP BY cause, sub_cause", {"ids": ids})
    by = {(c, s): t for c, s, t in rows}
    drift = by.get(("prefix_drift", "volatile_system"), 0)
    avoidable = sum(t for (c, _), t in by.items() if c != "unavoidable")
    print(f"\nvolatile_system tenant: {by}")
    assert drift > 0
    # all but the tenant's first request find a predecessor; their prefix misses are volatile_system
    assert drift >= 0.6 * avoidable


def test_second_turn_on_other_pod_is_routed_away(e2e) -> None:  # type: ignore[no-untyped-def]
    store = e2e["store"]
    moved = second_turns(e2e, moved=True)
    assert moved, "round robin sent no second turn to the other pod"
    rows = store.query_rows(
        "SELECT request_id, sum(tokens) FROM miss_attribution WHERE request_id IN {ids:Array(String)} "
        "AND cause = 'routed_away' GROUP BY request_id", {"ids": moved})
    print(f"\nsecond turns moved to another pod: {len(moved)}; attributed routed_away: {len(rows)}")
    assert {r[0] for r in rows} == set(moved)
    assert all(r[1] > 0 for r in rows)


def second_turns(e2e, *, moved: bool) -> list[str]:  # type: ignore[no-untyped-def]
    """Request ids of healthy chat second turns whose first turn the gateway log shows on another pod
    (``moved``) or on the same pod: ground truth from the log, not from the attribution."""
    by_id = {r["request_id"]: r for r in e2e["records"]}
    out = []
    for lab in e2e["labels"]:
        if lab["turn"] == 2 and lab["pathology"] == "none" and not lab.get("agent_run_id"):
            first = by_id.get(lab["request_id"][: -len("-t2")] + "-t1")
            second = by_id.get(lab["request_id"])
            if first and second and (first["pod"] != second["pod"]) == moved:
                out.append(second["request_id"])
    return out


def later_turns_that_stayed(e2e) -> list[str]:  # type: ignore[no-untyped-def]
    """Request ids of every later turn (2, 3, ...; any pathology, chats and agent runs) that the gateway log shows
    on the pod of the turn before it: its predecessor's pod, so never ``routed_away``. (Round robin with two
    concurrent clients places turns at random: healthy second turns alone stayed on their pod in too few runs.)"""
    by_id = {r["request_id"]: r for r in e2e["records"]}
    out = []
    for lab in e2e["labels"]:
        stem, sep, turn = lab["request_id"].rpartition("-t")
        if not sep or not turn.isdigit() or int(turn) < 2:
            continue
        before, this = by_id.get(f"{stem}-t{int(turn) - 1}"), by_id.get(lab["request_id"])
        if before and this and before["pod"] == this["pod"]:
            out.append(this["request_id"])
    return out


def test_later_turns_that_stayed_on_their_pod_are_never_routed_away(e2e) -> None:  # type: ignore[no-untyped-def]
    """Negative control for the test above: turns served by their previous turn's pod."""
    stayed = later_turns_that_stayed(e2e)
    rows = e2e["store"].query_rows(
        "SELECT request_id, cause FROM miss_attribution WHERE request_id IN {ids:Array(String)}", {"ids": stayed})
    print(f"\nsecond turns that stayed on their pod: {len(stayed)}; their causes: {sorted({c for _, c in rows})}")
    assert stayed, "round robin kept no later turn on its pod"
    answered = {r[0] for r in e2e["store"].query_rows(
        "SELECT request_id FROM request_attribution FINAL WHERE request_id IN {ids:Array(String)}", {"ids": stayed})}
    assert answered == set(stayed)  # every one judged (no answer would pass the check below)
    wrong = [r[0] for r in rows if r[1] == "routed_away"]
    detail = e2e["store"].query_rows(
        "SELECT request_id, pod, predecessor_request_id, predecessor_pod, cause, sub_cause, tokens, evidence, "
        "evidence_pod, predecessor_kind, gap_ms FROM miss_attribution WHERE request_id IN {ids:Array(String)}",
        {"ids": wrong})
    assert wrong == [], "\n".join(map(str, detail))


def test_kv_events_arrived_from_both_pods(e2e) -> None:  # type: ignore[no-untyped-def]
    rows = e2e["store"].query_rows(
        "SELECT pod, countIf(event_type = 'BlockStored') FROM kv_block_events GROUP BY pod ORDER BY pod")
    assert [r[0] for r in rows] == sorted(p.name for p in e2e["pods"])
    assert all(r[1] > 0 for r in rows)


def test_offsets_committed_nothing_redelivered(e2e) -> None:  # type: ignore[no-untyped-def]
    """A new member of the ingest group gets nothing: every message was committed after its insert."""
    from ingest.source import KafkaSource

    cfg = e2e["cfg"]
    src = KafkaSource(cfg.kafka_bootstrap, cfg.consumer_group, namespace=cfg.topic_namespace)
    try:
        got = []
        deadline = time.time() + 20
        while time.time() < deadline and not src.assignment():
            got += src.poll(500)
        for _ in range(4):
            got += src.poll(500)
        assert src.assignment(), "consumer never joined the group"
        assert got == []
    finally:
        src.close()


#: page path → (file stem for the screenshot, a selector that shows the page has drawn).
PAGES = {
    "": ("overview", ".st-key-hit_rate .js-plotly-plot"),
    "tenants": ("tenants", ".st-key-tenant_bars .js-plotly-plot"),
    "miss_causes": ("miss_causes", ".st-key-cause_bars .js-plotly-plot"),
    "fingerprints": ("fingerprints", ".st-key-fp_segments_tenants .js-plotly-plot"),
    "pods": ("pods", ".st-key-pod_hit_rate .js-plotly-plot"),
    "vllm": ("vllm", ".st-key-vllm_prompt_tokens_per_s .js-plotly-plot"),
    "data_quality": ("data_quality", "[data-testid='stMain'] [data-testid='stAlert']"),
    "ttl": ("ttl", ".st-key-ttl_survival .js-plotly-plot, .st-key-ttl_empty [data-testid='stAlert']"),
    "adhoc_sql": ("adhoc_sql", ".st-key-sql_run button"),
}
FIGURES = {"overview": ["hit_rate", "where_missed"], "tenants": ["tenant_bars"], "miss_causes": ["cause_bars"],
           "fingerprints": ["fp_segments_tenants"], "pods": ["pod_hit_rate"],
           "vllm": ["vllm_prompt_tokens_per_s", "vllm_e2e_ms"]}


@pytest.fixture(scope="module")
def dashboard_run(e2e, tmp_path_factory):  # type: ignore[no-untyped-def]
    """One `kvscope up` over the fleet (its own process and chDB directory) with live traffic through a gateway;
    every page opened in Debian's Chromium at a URL holding the traffic's window (from/to), read and screenshot to
    tests/artifacts/page-<name>.png, and a URL with every filter opened and changed; then `kvscope up` stops and the
    named queries run over the same store for the same window. Returns what the pages showed and what the queries
    say."""
    import os
    import subprocess
    import sys
    from datetime import UTC, timedelta

    from playwright.sync_api import sync_playwright

    from dashboard.data import NICE_BUCKETS, iso, parse_time
    from tests import dashboard_browser as db

    port = free_port()
    cfg = e2e["cfg"]
    work = tmp_path_factory.mktemp("dashboard")
    artifacts = Path(__file__).parent / "artifacts"
    artifacts.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    cmd = [sys.executable, "-m", "kvscope.cli", "up", "--data-dir", str(work / "data"), "--port", str(port),
           "--gateway-log", cfg.gateway_log, *[a for t in cfg.list("vllm") for a in ("--vllm", t)]]
    # The window starts at a minute boundary after the lines already in the log (the rollups resolve windows to
    # whole minutes), so it holds exactly this run's traffic.
    logged = [json.loads(line) for line in Path(cfg.gateway_log).read_text().splitlines() if line.strip()]
    newest = max((parse_time(r["ts"]) for r in logged), default=datetime.now(UTC))
    since = newest.replace(second=0, microsecond=0) + timedelta(minutes=1)
    shown: dict[str, Any] = {}
    with open(artifacts / "kvscope-up.log", "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: _http_ok(base) or proc.poll() is not None, 90, "the dashboard to listen")
            assert proc.poll() is None, (artifacts / "kvscope-up.log").read_text()[-3000:]
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=db.CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 2200})
                page.goto(base, wait_until="networkidle")  # whatever start-up shows (not asserted: a race)
                page.wait_for_timeout(1500)
                page.screenshot(path=str(artifacts / "page-startup.png"), full_page=True)
                time.sleep(max(2.0, (since - datetime.now(UTC)).total_seconds()))  # and its first scrape
                app = make_app([(p.name, p.base_url) for p in e2e["pods"]], Path(cfg.gateway_log),
                               policy="prefix_affinity", tokenizer_path=e2e["tokenizer"])
                with GatewayServer(app) as gw:
                    run_workload(gw.url, seed=23, scale=0.2, concurrency=2, wait_scale=0.2)  # seed 11: test_workload
                until = (datetime.now(UTC) + timedelta(seconds=13)).replace(microsecond=0)
                tenant, pod, model = busiest(Path(cfg.gateway_log), since)
                window = f"from={iso(since)}&to={iso(until)}"
                lines = sum(1 for line in Path(cfg.gateway_log).read_text().splitlines() if line.strip())
                settled = f"gateway log: just now ({lines:,} lines)"

                def caught_up() -> bool:  # every line stored and answered, a scrape after the window's end
                    page.goto(f"{base}/?{window}", wait_until="networkidle")
                    page.wait_for_selector("[data-testid='stMetricValue']", timeout=60_000)
                    page.wait_for_timeout(1000)
                    text = "\n".join(page.locator("[data-testid='stCaptionContainer']").all_inner_texts())
                    return (datetime.now(UTC) > until + timedelta(seconds=6) and "; 0 requests waiting" in text
                            and f"({lines:,} lines in the last day of data)" in text)
                wait_for(caught_up, 120, f"every line stored and answered ({settled})")
                for path, (name, ready) in PAGES.items():
                    shown[name] = read_page(page, db, f"{base}/{path}?{window}", ready, FIGURES.get(name, []),
                                            artifacts / f"page-{name}.png")
                shown["filters"] = filters_round_trip(page, db, f"{base}/tenants?{window}", tenant, pod, model,
                                                      artifacts / "page-filters.png")
                browser.close()
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    span = (until - since).total_seconds()
    width = next(b for b in NICE_BUCKETS if b >= span / 100)
    w = {"since": iso(since), "until": iso(until)}
    example = db.constant("dashboard/views/adhoc_sql.py", "EXAMPLE")
    whole_window = db.constant("dashboard/views/fingerprints.py", "WHOLE_WINDOW")
    expected = db.named_over(work / "data", "kvscope", {
        "hit_rate_total": ("hit_rate_total", w), "hit_rate": ("hit_rate", {**w, "bucket_seconds": str(width)}),
        "miss_causes": ("miss_causes", w), "tenant_affinity": ("tenant_affinity", w),
        "fingerprints": ("fingerprint_cardinality", {**w, "bucket_seconds": str(whole_window), "by_tenant": "1"}),
        "pods": ("pods", w), "dead_letters": ("dead_letters", {"since": w["since"], "until": w["until"]}),
        "vllm_series": ("vllm_series", {**w, "bucket_seconds": str(width)}),
        "vllm_latency": ("vllm_latency", {**w, "bucket_seconds": str(width), "by_pod": "1"}),
        "data_quality": ("data_quality", w),
        "filtered": ("tenant_affinity", {**w, "tenant": tenant, "pod": pod, "model": model}),
    }, sql={"example": example})
    yield {"shown": shown, "expected": expected, "since": since, "until": until, "width": width, "tenant": tenant,
           "pod": pod, "model": model, "pods": [p.name for p in e2e["pods"]]}


def busiest(log: Path, since: datetime) -> tuple[str, str, str]:
    """(tenant, pod, model) of the most requests logged since ``since``: a filter that shows numbers."""
    from collections import Counter

    from dashboard.data import parse_time

    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    counts = Counter((r["tenant_id"], r["pod"], r["model"]) for r in lines if parse_time(r["ts"]) >= since)
    return counts.most_common(1)[0][0]


def read_page(page, db, url: str, ready: str, keys: list[str], shot: Path) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Opens ``url``, waits for ``ready``, and returns its tiles, alerts, captions and the figures ``keys``."""
    page.goto(url, wait_until="networkidle")
    page.wait_for_selector(ready, timeout=60_000)
    page.wait_for_timeout(2500)  # the rest of the page after the element waited for
    if "adhoc_sql" in url:
        page.locator(".st-key-sql_run button").click()
        page.get_by_text(re.compile(r"^\d+ rows")).first.wait_for(timeout=30_000)
    out = {"metrics": db.metrics(page), "alerts": db.alerts(page), "url": page.url,
           "captions": page.locator("[data-testid='stCaptionContainer']").all_inner_texts(),
           "figures": {k: db.figure(page, k) for k in keys}}
    page.screenshot(path=str(shot), full_page=True)
    return out


def filters_round_trip(page, db, url: str, tenant: str, pod: str, model: str,  # type: ignore[no-untyped-def]
                       shot: Path) -> dict[str, Any]:
    """Opens ``url`` with every filter set: what the sidebar shows and the tenant bars drew; then picks "All pods"
    in the sidebar and returns the URL it led to."""
    page.goto(f"{url}&tenant={tenant}&pod={pod}&model={model}", wait_until="networkidle")
    page.wait_for_selector(".st-key-tenant_bars .js-plotly-plot", timeout=60_000)
    page.wait_for_timeout(2500)
    out = {"widgets": {k: db.widget(page, k) for k in ("time_range", "range_from", "range_to", "tenant", "pod",
                                                         "model")},
           "bars": db.figure(page, "tenant_bars")}
    page.screenshot(path=str(shot), full_page=True)
    page.locator(".st-key-pod").click()
    page.get_by_role("option", name="All pods").click()
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:  # the app rewrites the URL after its rerun: on a loaded machine that takes seconds
        page.wait_for_function("() => !new URLSearchParams(location.search).has('pod')", timeout=30_000)
    except PlaywrightTimeout:
        pass  # the assertions report the URL as it stands
    out["url_after"] = page.url
    out["pod_after"] = db.widget(page, "pod")
    return out


def _pct(x: float | None) -> str:
    from dashboard.charts import pct

    return pct(x)


@pytest.mark.browser
def test_overview_in_chromium_shows_hit_rate_total(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    """The tiles equal hit_rate_total; the hit-rate chart's gateway points equal hit_rate; the axis spans the URL's
    window, the title states the bucket; where the missed tokens went equals miss_causes."""
    from dashboard.charts import count
    from tests.dashboard_browser import bucket_key, points

    shown, expected = dashboard_run["shown"]["overview"], dashboard_run["expected"]
    by = {r["source"]: r for r in expected["hit_rate_total"]}
    gw, vllm = by["gateway"], by["vllm"]
    m = shown["metrics"]
    print(f"\noverview tiles: {m}")
    assert m["Token-weighted hit rate (vLLM)"] == _pct(vllm["token_weighted_hit_rate"])
    assert m["Token-weighted hit rate (gateway)"] == _pct(gw["token_weighted_hit_rate"])
    assert m["Request-weighted hit rate (gateway)"] == _pct(gw["request_weighted_hit_rate"])
    assert m["Cached-count coverage (gateway)"] == _pct(gw["cached_tokens_coverage"])
    assert m["Prefill tokens saved"] == count(gw["hit_tokens"])
    assert m["Missed tokens"] == count(gw["query_tokens"] - gw["hit_tokens"])
    assert gw["requests"] > 10 and vllm["query_tokens"] > 1000
    fig = shown["figures"]["hit_rate"]
    assert fig["title"].endswith(f"· 1 bucket = {dashboard_run['width'] // 60} min")
    line = points(fig, "Token-weighted hit rate, gateway log")
    rows = [r for r in expected["hit_rate"] if r["source"] == "gateway"]
    assert rows and {bucket_key(r["bucket"]): pytest.approx(r["token_weighted_hit_rate"]) for r in rows} == line
    start, end = fig["xrange"]
    assert start[:16].replace("T", " ") <= str(dashboard_run["since"])[:16] <= str(dashboard_run["until"])[:16] \
        <= end[:16].replace("T", " ")
    where = shown["figures"]["where_missed"]["traces"][0]
    drawn = dict(zip(where["y"], where["x"], strict=True))
    from dashboard.causes import label

    assert drawn == {label(r["cause"], r["sub_cause"]): r["missed_tokens"] for r in expected["miss_causes"]}


@pytest.mark.browser
def test_tenants_in_chromium_show_tenant_affinity(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    fig = dashboard_run["shown"]["tenants"]["figures"]["tenant_bars"]
    rows = dashboard_run["expected"]["tenant_affinity"]
    for column, name in (("tenant_cache_affinity", "Tenant cache affinity"),
                         ("token_weighted_hit_rate", "Token-weighted hit rate")):
        (trace,) = [t for t in fig["traces"] if t["name"] == name]
        drawn = {x: y for x, y in zip(trace["x"], trace["y"], strict=True) if y is not None}
        assert drawn == {r["tenant_id"]: pytest.approx(r[column]) for r in rows if r[column] is not None}, name
    assert len(rows) >= 4  # the workload's tenants


@pytest.mark.browser
def test_miss_causes_in_chromium_show_miss_causes(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    from dashboard import causes
    from dashboard.charts import count

    shown, rows = dashboard_run["shown"]["miss_causes"], dashboard_run["expected"]["miss_causes"]
    assert shown["metrics"]["Missed tokens"] == count(sum(r["missed_tokens"] for r in rows))
    drawn = shown["figures"]["cause_bars"]["traces"]
    bars = {t["name"]: (t["x"][0], t["color"]) for t in drawn if t["type"] == "bar"}
    assert bars == {causes.label(r["cause"], r["sub_cause"]):
                    (r["missed_tokens"], causes.color(r["cause"], r["sub_cause"])) for r in rows}
    assert "prefix_drift / volatile_system" in bars  # the workload's globex tenant


@pytest.mark.browser
def test_fingerprints_in_chromium_show_fingerprint_cardinality(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    from tests.dashboard_browser import constant

    segments = constant("dashboard/views/fingerprints.py", "SEGMENTS")
    (cells,) = dashboard_run["shown"]["fingerprints"]["figures"]["fp_segments_tenants"]["traces"]
    drawn = {(tenant, segment): cells["text"][i][j] for i, tenant in enumerate(cells["y"])
             for j, segment in enumerate(cells["x"])}
    want = {}
    for r in dashboard_run["expected"]["fingerprints"]:
        for segment, (raw, norm) in segments.items():
            want[(r["tenant_id"], segment)] = "not used" if r[raw] == 0 else f"{r[raw]} raw / {r[norm]} normalized"
    assert drawn == want


@pytest.mark.browser
def test_pods_in_chromium_show_pods(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    shown, rows = dashboard_run["shown"]["pods"], dashboard_run["expected"]["pods"]
    fig = shown["figures"]["pod_hit_rate"]
    for column, name in (("token_weighted_hit_rate", "Token-weighted hit rate (gateway)"),
                         ("vllm_token_weighted_hit_rate", "Token-weighted hit rate (vLLM)")):
        (trace,) = [t for t in fig["traces"] if t["name"] == name]
        assert dict(zip(trace["x"], trace["y"], strict=True)) == {
            r["pod"]: pytest.approx(r[column]) for r in rows if r[column] is not None}, name
    assert {r["pod"] for r in rows} == set(dashboard_run["pods"])
    good_news = any("No dead letters: every line and event parsed." in a for a in shown["alerts"])
    assert good_news == (dashboard_run["expected"]["dead_letters"] == [])


@pytest.mark.browser
def test_vllm_page_in_chromium_shows_vllm_series(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    """Per-pod prompt throughput equals vllm_series; end-to-end p50 equals vllm_latency (bucket-interpolated)."""
    from tests.dashboard_browser import bucket_key, points

    figs = dashboard_run["shown"]["vllm"]["figures"]
    series, latency = dashboard_run["expected"]["vllm_series"], dashboard_run["expected"]["vllm_latency"]
    pods = sorted({r["pod"] for r in series})
    assert len(pods) == 2
    for pod in pods:
        drawn = points(figs["vllm_prompt_tokens_per_s"], pod)
        assert drawn == {bucket_key(r["bucket"]): pytest.approx(r["prompt_tokens_per_s"]) for r in series
                         if r["pod"] == pod}
        assert max(drawn.values()) > 0
        e2e = points(figs["vllm_e2e_ms"], f"{pod}, p50")
        assert e2e == {bucket_key(r["bucket"]): pytest.approx(r["p50_ms"]) for r in latency
                       if r["pod"] == pod and r["metric"] == "e2e_ms" and r["p50_ms"] is not None}
    assert figs["vllm_prompt_tokens_per_s"]["title"].endswith("1 bucket = 1 min")


@pytest.mark.browser
def test_data_quality_in_chromium_shows_data_quality(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    alerts = dashboard_run["shown"]["data_quality"]["alerts"]
    rows = dashboard_run["expected"]["data_quality"]
    disagree = sorted(r["pod"] for r in rows if r["likely_cause"] != "agree")
    if not disagree:
        assert any(f"Both sources agree on every pod ({len(rows)})." in a for a in alerts)
    else:
        assert sorted(a.split(":")[0] for a in alerts if a.split(":")[0] in {r["pod"] for r in rows}) == disagree


@pytest.mark.browser
def test_sql_page_in_chromium_runs_the_example(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    captions = dashboard_run["shown"]["adhoc_sql"]["captions"]
    n = len(dashboard_run["expected"]["example"])
    assert f"{n:,} rows" in captions and n >= 4


@pytest.mark.browser
def test_every_page_screenshot_and_sources(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    """A screenshot of every page; the sidebar says how fresh each source is (no KV events here: this
    `kvscope up` binds no KV-event endpoint)."""
    artifacts = Path(__file__).parent / "artifacts"
    for name, _ in PAGES.values():
        assert (artifacts / f"page-{name}.png").stat().st_size > 20_000, name
    sources = next(c for c in dashboard_run["shown"]["pods"]["captions"] if c.startswith("Sources"))
    print(f"\nsidebar: {sources}")
    assert re.search(r"last scrape (just now|\d+ s ago)", sources)
    assert "no KV events: routed_away/evicted are inferred from which pod served the predecessor" in sources


@pytest.mark.browser
def test_url_with_filters_reopens_the_same_view(dashboard_run) -> None:  # type: ignore[no-untyped-def]
    """/tenants?from&to&tenant&pod&model: the sidebar shows each value, the page only that tenant's numbers for that
    pod and model (tenant_affinity with the same filters); picking "All pods" takes pod out of the URL."""
    from dashboard.data import CUSTOM

    got = dashboard_run["shown"]["filters"]
    since, until = dashboard_run["since"], dashboard_run["until"]
    assert got["widgets"] == {"time_range": CUSTOM, "range_from": since.strftime("%Y-%m-%dT%H:%M"),
                              "range_to": until.strftime("%Y-%m-%dT%H:%M"), "tenant": dashboard_run["tenant"],
                              "pod": dashboard_run["pod"], "model": dashboard_run["model"]}
    (row,) = dashboard_run["expected"]["filtered"]
    trace = next(t for t in got["bars"]["traces"] if t["name"] == "Token-weighted hit rate")
    assert (trace["x"], trace["y"]) == ([dashboard_run["tenant"]], [pytest.approx(row["token_weighted_hit_rate"])])
    assert f"tenant={dashboard_run['tenant']}" in got["url_after"] and "from=" in got["url_after"]
    assert "pod=" not in got["url_after"]
    assert got["pod_after"] == "All pods"


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
