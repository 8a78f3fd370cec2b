"""Precise mode, gateway side (gateway/block_chain.py): which /tokenize body reproduces a request's prompt, the
block size read from /metrics, and on real vLLM that each logged ``prompt_block_hashes`` is exactly the chain the
collector derives from the serving pod's ``BlockStored`` events (same token ids, same hash)."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from gateway.block_chain import ChainFailure, parse_block_size, tokenize_request
from gateway.proxy import GatewayServer, make_app
from kvscope.config import build_config
from kvscope.pipeline import Pipeline
from tests.kill_harness import wait_until

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def test_a_chat_request_keeps_every_field_that_shapes_its_prompt() -> None:
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": False,
            "continue_final_message": True, "add_special_tokens": True, "chat_template": "{{ x }}",
            "chat_template_kwargs": {"enable_thinking": False, "x": 1}, "documents": [{"text": "d"}],
            "reasoning_effort": "low", "stream": True, "max_tokens": 5, "temperature": 0.3,
            "stream_options": {"include_usage": True}, "tool_choice": "auto"}
    assert tokenize_request(body, "chat.completions") == {
        "model": "tiny", "messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": False,
        "continue_final_message": True, "add_special_tokens": True, "chat_template": "{{ x }}",
        # vLLM merges documents and reasoning_effort over the user's kwargs; the user's enable_thinking stays
        "chat_template_kwargs": {"enable_thinking": False, "x": 1, "documents": [{"text": "d"}],
                                 "reasoning_effort": "low"}}


def test_a_plain_chat_request_sends_messages_only_and_effort_derives_enable_thinking() -> None:
    assert tokenize_request({"model": "m", "messages": MESSAGES}, "chat.completions") == {
        "model": "m", "messages": MESSAGES}
    assert tokenize_request({"messages": MESSAGES, "reasoning_effort": "none"}, "chat.completions") == {
        "messages": MESSAGES, "chat_template_kwargs": {"reasoning_effort": "none", "enable_thinking": False}}
    assert tokenize_request({"messages": MESSAGES, "reasoning_effort": "auto"}, "chat.completions") == {
        "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}


def test_completion_prompts() -> None:
    assert tokenize_request({"model": "m", "prompt": "abc"}, "completions") == {"model": "m", "prompt": "abc"}
    assert tokenize_request({"prompt": ["abc"], "add_special_tokens": False}, "completions") == {
        "prompt": "abc", "add_special_tokens": False}
    assert tokenize_request({"prompt": [5, 6, 7]}, "completions") == [5, 6, 7]  # token ids: no call needed
    assert tokenize_request({"prompt": [[5, 6]]}, "completions") == [5, 6]


@pytest.mark.parametrize(("body", "endpoint"), [
    ({"prompt": ["a", "b"]}, "completions"),                        # two prompts in one request
    ({"prompt": ["a", 7]}, "completions"),
    ({"prompt": [5, -1]}, "completions"),
    ({"prompt": [5, True]}, "completions"),
    ({"prompt": None}, "completions"),
    ({"prompt": "abc", "truncate_prompt_tokens": 10}, "completions"),  # the pod prefills a cut prompt
    ({"prompt_embeds": "AAAA"}, "completions"),
    ({"messages": "hi"}, "chat.completions"),
    ({"messages": MESSAGES, "truncate_prompt_tokens": 5}, "chat.completions"),
])
def test_prompts_tokenize_cannot_reproduce_are_refused(body: dict, endpoint: str) -> None:
    with pytest.raises(ChainFailure) as info:
        tokenize_request(body, endpoint)
    assert info.value.reason == "unsupported_body"


def test_block_size_from_cache_config_info() -> None:
    text = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
            '# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="2048"} 1.0\n'
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n')
    assert parse_block_size(text) == 32
    assert parse_block_size(text.replace('block_size="32"', 'block_size="0"')) is None
    assert parse_block_size('vllm:cache_config_info{cache_dtype="auto"} 1.0\nother{block_size="16"} 1\n') is None
    assert parse_block_size("") is None


def _words(seed: str, n: int) -> str:
    import random

    rng = random.Random(seed)
    vocab = "cache block prefix token pod gateway tenant refund order shipping agent tool schema answer".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


@pytest.mark.vllm
def test_logged_chains_equal_the_chains_of_the_pods_block_stored_events(vllm_fleet, store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A few chat requests (two turns, tools, a stream) and a completion through the gateway (round robin over
    both pods); the collector binds the KV-event socket. Each request's logged chain must be made of chain hashes
    the collector derived from BlockStored events of the pod that served it, one per full 32-token block of the
    prompt vLLM reported; a request seen by one pod only has none of its blocks on the other (the check can fail)."""
    run = uuid.uuid4().hex[:8]
    log = tmp_path / "gateway.jsonl"
    pods = vllm_fleet.pods
    cfg = replace(build_config({}, environ={}), database=store.database, state_dir=str(tmp_path / "state"),
                  gateway_log=str(log), kv_events_endpoint=vllm_fleet.kv_events_endpoint,
                  kv_events_replay=",".join(f"{p.kv_events_topic}={p.kv_replay_endpoint}" for p in pods),
                  scrape_interval_seconds=3600, attribution_interval_seconds=3600)
    pipe = Pipeline(cfg, store=store)
    system_a = f"run {run}. " + _words(run + "a", 120)
    turn_1 = [{"role": "system", "content": system_a}, {"role": "user", "content": _words(run + "q1", 30)}]
    turn_2 = [*turn_1, {"role": "assistant", "content": _words(run + "r1", 20)},
              {"role": "user", "content": _words(run + "q2", 30)}]
    other = [{"role": "system", "content": f"other {run}. " + _words(run + "b", 90)},
             {"role": "user", "content": "go"}]
    requests = [  # round robin: pod-0, pod-1, pod-0, pod-1
        ("/v1/chat/completions", {"messages": turn_1}),
        ("/v1/chat/completions", {"messages": turn_2}),
        ("/v1/chat/completions", {"messages": other, "tools": TOOLS, "tool_choice": "none", "stream": True}),
        ("/v1/completions", {"prompt": f"plain {run} " + _words(run + "c", 80)}),
    ]
    with GatewayServer(make_app([(p.name, p.base_url) for p in pods], log, policy="round_robin")) as gw:
        pipe.start()
        try:
            with httpx.Client(base_url=gw.url, timeout=120) as client:
                # vLLM reconnects its publisher to the collector's fresh socket: warm up until both pods' events
                # arrive (a unique prompt per try, so each try stores new blocks)
                def events_from_both() -> bool:
                    for _ in range(2):
                        client.post("/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                            "prompt": f"warm {uuid.uuid4().hex} " + _words(run, 60)},
                                    headers={"X-Request-Id": f"warm-{uuid.uuid4().hex}"}).raise_for_status()
                    rows = store.query_rows("SELECT uniqExact(pod) FROM kv_block_events WHERE event_type = "
                                            "'BlockStored' AND has(chain_hashes, 0) = 0 AND length(chain_hashes) > 0")
                    return rows[0][0] == len(pods)
                wait_until(events_from_both, 90, "KV events from both pods", interval=2.0)
                ids = []
                for i, (path, body) in enumerate(requests):
                    rid = f"chain-{run}-{i}"
                    r = client.post(path, json={"model": "tiny", "max_tokens": 4, **body},
                                    headers={"X-Request-Id": rid})
                    assert r.status_code == 200, r.text
                    ids.append(rid)
            wait_until(lambda: store.query_rows("SELECT count() FROM gateway_requests WHERE request_id IN "
                                                "{ids:Array(String)}", {"ids": ids})[0][0] == len(ids),
                       60, "every request's row")

            def stored() -> dict[str, set[int]]:
                rows = store.query_rows("SELECT pod, groupUniqArrayArray(chain_hashes) FROM kv_block_events "
                                        "WHERE event_type = 'BlockStored' GROUP BY pod")
                return {pod: set(hashes) for pod, hashes in rows}

            rows = store.query_rows(
                "SELECT request_id, pod, prompt_tokens, prompt_block_size, prompt_block_hashes FROM gateway_requests "
                "WHERE request_id IN {ids:Array(String)} ORDER BY request_id", {"ids": ids})
            wait_until(lambda: all(set(h) <= stored().get(pod, set()) for _, pod, _, _, h in rows), 30,
                       "the requests' blocks in the KV events")
        finally:
            pipe.close()
    held = stored()
    assert [r[0] for r in rows] == ids
    assert [r[1] for r in rows] == [pods[i % 2].name for i in range(len(requests))]
    for rid, pod, prompt_tokens, block_size, chain in rows:
        print(f"\n{rid} on {pod}: {prompt_tokens} prompt tokens, {len(chain)} blocks of {block_size}")
        assert block_size == 32
        assert len(chain) == prompt_tokens // 32 >= 3, rid
        assert 0 not in chain and len(set(chain)) == len(chain)
        assert set(chain) <= held[pod], f"{rid}: blocks the pod never stored"
    # the stream and the completion ran on one pod only: none of their blocks is on the other
    for rid, pod, _, _, chain in rows[2:]:
        other_pod = next(p.name for p in pods if p.name != pod)
        assert not set(chain) & held[other_pod], rid
    # turn 2 repeats turn 1's prompt (same system and first user message), so its chain starts with turn 1's
    # whole blocks up to where the texts part (the chat template closes turn 1 with the generation prompt)
    assert rows[1][4][:2] == rows[0][4][:2]


def test_the_sliced_chain_equals_the_whole_chain() -> None:
    """The gateway hashes 8 blocks at a time, yielding to the loop between slices; each slice chains from the
    last: the result is kvscope.block_hash.chain_hashes of the whole prompt, at every length around a slice edge."""
    import asyncio
    import random

    from gateway.block_chain import SLICE_BLOCKS, DigestMemo, _chain_hashes
    from kvscope.block_hash import chain_hashes

    rng = random.Random(9)
    memo = DigestMemo(max_entries=40)  # shared and small: hits, misses and evictions all happen
    for n in (0, 15, 16, SLICE_BLOCKS * 16 - 1, SLICE_BLOCKS * 16, SLICE_BLOCKS * 16 + 16, 1000, 1000):
        ids = [rng.randrange(32_000) for _ in range(n)] if n != 1000 else list(range(5, 1005))
        want = [f"{h:016x}" for h in chain_hashes(ids, 16)]
        assert asyncio.run(_chain_hashes(ids, 16)) == want, n
        assert asyncio.run(_chain_hashes(ids, 16, memo)) == want, n
        assert len(memo) <= 40
        salted = [f"{h:016x}" for h in chain_hashes(ids, 16, cache_salt="s")]  # the salt keys the first block
        assert asyncio.run(_chain_hashes(ids, 16, memo, "s")) == salted, n
        assert all(x != y for x, y in zip(salted, want, strict=True))
    assert len(asyncio.run(_chain_hashes(list(range(1000)), 16))) == 62  # full blocks only


def test_the_chain_helper_outlives_a_ctrl_c_and_exits_when_the_gateway_closes() -> None:
    """The helper process (gateway/chain_worker.py) ignores SIGINT (Ctrl-C on `kvscope demo` reaches the whole
    process group; the gateway shuts it down), and exits with 0 when the gateway closes its socket."""
    import asyncio
    import signal

    from gateway.chain_worker import RemoteChainer
    from gateway.upstream import Timeouts, UpstreamClient

    async def scenario() -> tuple[int | None, int | None]:
        chainer = RemoteChainer({"pod-0": "http://127.0.0.1:9"})
        await chainer.start()
        proc = chainer._proc
        assert proc is not None
        client = UpstreamClient(Timeouts(connect=1.0, read=1.0))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        # an answer (nothing listens on port 9: no chain) proves the helper's loop runs, its handler installed
        assert await chainer.chain(client, "pod-0", body, "/v1/chat/completions", None) == ([], 0)
        await client.aclose()
        proc.send_signal(signal.SIGINT)
        await asyncio.sleep(1)
        alive = proc.poll()
        await chainer.aclose()
        return alive, proc.wait(timeout=30)

    assert asyncio.run(scenario()) == (None, 0)



def test_the_chain_helper_closes_after_the_loops_executor_is_shut_down() -> None:
    """The gateway's shutdown may run when the loop's executor takes no more work (a signalled `make demo`:
    ``cannot schedule new futures after interpreter shutdown``): closing the helper waits for it on the loop, not
    on a thread, and the helper still exits with 0."""
    import asyncio

    from gateway.chain_worker import RemoteChainer

    async def scenario() -> int | None:
        chainer = RemoteChainer({"pod-0": "http://127.0.0.1:9"})
        await chainer.start()
        proc = chainer._proc
        assert proc is not None
        await asyncio.get_running_loop().shutdown_default_executor()
        await chainer.aclose()
        return proc.poll()

    assert asyncio.run(scenario()) == 0


@pytest.mark.vllm
def test_a_cache_salt_isolates_the_prompt_on_a_real_pod(vllm_fleet, store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One prompt through the gateway to one real vLLM pod with cache_salt A, again with A, then with B. vLLM hits
    the second A (cached_tokens ≥ a block) and nothing of B (0); A's logged chain is made of the hashes vLLM itself
    published in its BlockStored events (and equals the collector's chain hashes), B's chain shares no block with
    A's; attribution (precise mode) reads B as cold, not evicted, routed away or unknown: it could reuse nothing."""
    from ingest.attribution_job import run_attribution

    run = uuid.uuid4().hex[:8]
    log = tmp_path / "gateway.jsonl"
    pod = vllm_fleet.pods[0]
    cfg = replace(build_config({}, environ={}), database=store.database, state_dir=str(tmp_path / "state"),
                  gateway_log=str(log), kv_events_endpoint=vllm_fleet.kv_events_endpoint,
                  kv_events_replay=f"{pod.kv_events_topic}={pod.kv_replay_endpoint}",
                  scrape_interval_seconds=3600, attribution_interval_seconds=3600)
    pipe = Pipeline(cfg, store=store)
    messages = [{"role": "system", "content": f"salted run {run}. " + _words(run + "s", 150)},
                {"role": "user", "content": _words(run + "q", 20)}]
    sent = [(f"salt-{run}-a1", "A"), (f"salt-{run}-a2", "A"), (f"salt-{run}-b1", "B")]
    salt = {"A": f"tenant-a-{run}", "B": f"tenant-b-{run}"}
    with GatewayServer(make_app([(pod.name, pod.base_url)], log, policy="round_robin")) as gw:
        pipe.start()
        try:
            with httpx.Client(base_url=gw.url, timeout=180) as client:
                def events_arrive() -> bool:  # the pod reconnects its publisher to the collector's fresh socket
                    client.post("/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                        "prompt": f"warm {uuid.uuid4().hex} " + _words(run, 60)},
                                headers={"X-Request-Id": f"warm-{uuid.uuid4().hex}"}).raise_for_status()
                    return store.query_rows("SELECT count() FROM kv_block_events WHERE pod = {p:String} AND "
                                            "event_type = 'BlockStored'", {"p": pod.name})[0][0] > 0
                wait_until(events_arrive, 120, "KV events from the pod", interval=2.0)
                cached = {}
                for rid, which in sent:
                    r = client.post("/v1/chat/completions", headers={"X-Request-Id": rid},
                                    json={"model": "tiny", "max_tokens": 2, "messages": messages,
                                          "cache_salt": salt[which]})
                    assert r.status_code == 200, r.text
                    cached[rid] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            ids = [rid for rid, _ in sent]
            wait_until(lambda: store.query_rows("SELECT count() FROM gateway_requests WHERE request_id IN "
                                                "{ids:Array(String)}", {"ids": ids})[0][0] == len(ids),
                       60, "every request's row")
            rows = {r[0]: r[1:] for r in store.query_rows(
                "SELECT request_id, prompt_tokens, cached_tokens, cache_salt_hash, prompt_block_hashes "
                "FROM gateway_requests WHERE request_id IN {ids:Array(String)}", {"ids": ids})}
            chain_a, chain_b = rows[ids[0]][3], rows[ids[2]][3]

            def published() -> tuple[set[int], set[int]]:
                (vllm_hashes, chains), = store.query_rows(
                    "SELECT groupUniqArrayArray(block_hashes), groupUniqArrayArray(chain_hashes) FROM kv_block_events "
                    "WHERE pod = {p:String} AND event_type = 'BlockStored'", {"p": pod.name})
                return set(vllm_hashes), set(chains)
            wait_until(lambda: set(chain_a) | set(chain_b) <= published()[1], 60, "A's and B's blocks in the events")
        finally:
            pipe.close()
    vllm_hashes, chains = published()
    a1, a2, b1 = ids
    print(f"\ncached tokens {cached}; prompt {rows[a1][0]} tokens, {len(chain_a)} blocks")
    assert cached[a2] >= 32 and cached[b1] == 0
    assert rows[a1][2] == rows[a2][2] != rows[b1][2] != ""
    assert salt["A"] not in log.read_text() and salt["B"] not in log.read_text()
    assert len(chain_a) == rows[a1][0] // 32 >= 3 and rows[a2][3] == chain_a
    assert set(chain_a) <= vllm_hashes  # vLLM's own salted block hashes: the chain equals what the pod publishes
    assert len(chain_b) == rows[b1][0] // 32 >= 3
    assert not set(chain_a) & set(chain_b) and set(chain_b) <= vllm_hashes
    run_attribution(store, settle_seconds=0.0, default_block_size=32)
    verdict = {r[0]: r[1:] for r in store.query_rows(
        "SELECT request_id, causes, sub_causes, evidence FROM request_attribution FINAL "
        "WHERE request_id IN {ids:Array(String)}", {"ids": ids})}
    causes_b = verdict[b1][0]
    print(f"b1: {verdict[b1]}")
    assert "cold" in causes_b and not {"evicted", "unknown", "routed_away"} & set(causes_b)


@pytest.mark.vllm
def test_a_real_pod_answers_tokenize_and_models_as_the_fake_pod_imitates(vllm_fleet) -> None:  # type: ignore[no-untyped-def]
    """The fake pod of tests/test_gateway_proxy.py stands in for vLLM in the /tokenize failure tests; here the
    real server says the same: /tokenize for a model it does not serve answers 404 with vLLM's own error object
    (so the gateway counts ``tokenize_failed`` and asks again next time, not ``tokenize_unavailable``, which
    would leave the pod without chains for RETRY_SECONDS), its own model's ids decode, and /v1/models lists the
    served name with no parent (a base model, not a LoRA adapter)."""
    import asyncio

    from gateway.block_chain import BlockChainer
    from gateway.upstream import Timeouts, UpstreamClient

    pod = vllm_fleet.pods[0]
    chainer = BlockChainer({pod.name: pod.base_url})
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}

    async def tokenize(model: str) -> tuple[str, list[int] | None]:
        client = UpstreamClient(Timeouts(connect=5.0, read=60.0))
        try:
            payload = json.dumps({**body, "model": model}).encode()
            return "ok", await chainer._tokenize(client, pod.name, payload)
        except ChainFailure as failure:
            return failure.reason, None
        finally:
            await client.aclose()

    assert asyncio.run(tokenize("no-such-model")) == ("tokenize_failed", None)
    assert chainer.pods[pod.name].tokenize_retry_at == 0.0  # not left alone: asked again next time
    reason, ids = asyncio.run(tokenize("tiny"))
    assert reason == "ok" and ids and all(isinstance(i, int) for i in ids)
    raw = httpx.post(f"{pod.base_url}/tokenize", json=body, timeout=60)
    assert raw.status_code == 404 and b'"error"' in raw.content
    models = httpx.get(f"{pod.base_url}/v1/models", timeout=60).json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None)]
