"""The reference gateway in front of real vLLM servers (`vllm_fleet`), plus the paths that need no vLLM
(unreachable pod, bad body) and those tested against `FakePod`, a real local HTTP server answering like
vLLM, for what vLLM cannot show us (the forwarded body, connection reuse) or quickly."""

from __future__ import annotations

import json
import math
import os
import random
import time
import uuid
from pathlib import Path

import httpx
import jsonschema
import pytest
from conftest import free_port

from collector.gateway_log import read_file
from collector.gateway_record import NAME_MAX_CHARS as CONTRACT_NAME_MAX_CHARS
from collector.gateway_record import decode_record
from gateway.block_chain import MODELS_REFRESH_SECONDS
from gateway.fingerprint import TokenCounter, fingerprint_chat
from gateway.log import SCHEMA_PATH
from gateway.proxy import NAME_MAX_CHARS, GatewayServer, fit_name, make_app

WORDS = (
    "cache block prefix token pod gateway tenant policy refund order shipping warranty agent tool "
    "schema document history system prompt answer request latency queue decode prefill"
).split()


def long_text(n_words: int, seed: str) -> str:
    """A prompt of `n_words` words that starts with `seed` (so no other test shares its first block)."""
    rnd = random.Random(seed)
    return seed + " " + " ".join(rnd.choice(WORDS) for _ in range(n_words))


_VALIDATOR = None


def validate(record: dict) -> dict:
    global _VALIDATOR
    if _VALIDATOR is None:
        schema = json.loads(SCHEMA_PATH.read_text())
        cls = jsonschema.validators.validator_for(schema)
        _VALIDATOR = cls(schema, format_checker=cls.FORMAT_CHECKER)
    _VALIDATOR.validate(record)
    decode_record(json.dumps(record))  # kvscope's reader accepts it too (BadRecord says why not)
    return record


def log_line(log_path: Path, request_id: str, timeout_seconds: float = 20.0) -> dict:
    """The validated log record of `request_id` (written just after the response's last byte)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        if log_path.exists():
            found = [json.loads(x) for x in log_path.read_text().splitlines() if request_id in x]
            found = [r for r in found if r["request_id"] == request_id]
            if found:
                assert len(found) == 1, f"{len(found)} lines for {request_id}"
                return validate(found[0])
        if time.monotonic() > deadline:
            raise AssertionError(f"no log line for {request_id}")
        time.sleep(0.02)


@pytest.fixture
def gateway(tmp_path):
    """Factory: gateway(pods, **make_app kwargs) → (client, log_path); servers stop at teardown."""
    servers, clients = [], []

    def start(pods, **kwargs):
        log_path = tmp_path / f"gateway-{len(servers)}.jsonl"
        server = GatewayServer(make_app(pods, log_path, **kwargs)).start()
        servers.append(server)
        clients.append(httpx.Client(base_url=server.url, timeout=60))
        return clients[-1], log_path

    yield start
    for client in clients:
        client.close()
    for server in servers:
        server.stop()


# --- no pod needed ----------------------------------------------------------------------------------------


def test_unreachable_pod_gives_502_and_a_log_line(gateway):
    client, log_path = gateway([("dead-0", f"http://127.0.0.1:{free_port()}")], policy="prefix_affinity")
    r = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Request-Id": "gw-dead-1", "X-Tenant-Id": "acme"},
    )
    assert r.status_code == 502 and r.headers["x-request-id"] == "gw-dead-1"
    assert "no pod reachable" in r.json()["error"]["message"]
    rec = log_line(log_path, "gw-dead-1")
    assert rec["status"] == 502 and rec["error"] == "502 GatewayError: no pod reachable (tried dead-0)"
    assert rec["pod"] == "dead-0" and rec["tenant_id"] == "acme"
    assert rec["prompt_tokens"] == 0 and rec["suffix_tokens"] > 0
    assert client.get("/health").json()["pods"][0]["up"] is False


def test_invalid_body_gives_400_and_a_log_line(gateway):
    client, log_path = gateway([("dead-0", f"http://127.0.0.1:{free_port()}")])
    r = client.post("/v1/completions", content=b"{not json", headers={"X-Request-Id": "gw-bad-1"})
    assert r.status_code == 400
    rec = log_line(log_path, "gw-bad-1")
    assert rec["status"] == 400 and rec["endpoint"] == "completions" and rec["pod"] == ""


class FakePod:
    """A real HTTP/1.1 server (stdlib, one thread per connection, keep-alive) answering like vLLM 0.32:
    /v1/chat/completions and /v1/completions with usage incl. `prompt_tokens_details.cached_tokens`, as JSON
    or, for `stream: true`, as SSE in chunked transfer encoding; GET /v1/models. `requests` records what
    arrived (raw body, headers); `status` makes it answer with an OpenAI-style error; `idle_timeout`
    closes idle keep-alive connections (as uvicorn does after 5 s); `connections` counts accepted ones.
    `details` shapes usage.prompt_tokens_details: "reported" (cached_tokens 4), "null" (vLLM without
    --enable-prompt-tokens-details), "absent" or "no_key" (forks), "no_usage" (a stream without its usage
    chunk: a server that ignores `include_usage`); `cut_stream` closes a stream after its
    content chunks, before the usage chunk and the end of the chunked body (a pod that dies mid-stream).
    Precise mode: POST /tokenize answers 404 (a server without it) unless `token_ids` is set, then with those
    ids after `tokenize_delay` seconds (recorded in `tokenize_requests`, not `requests`); GET /metrics has
    `vllm:cache_config_info{block_size="4"}` (`block_size`; `metrics_status` another status; `metrics_reads` counts
    the reads)."""

    def __init__(self, idle_timeout: float | None = None) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        pod = self
        self.requests: list[dict] = []
        self.status = 200
        self.error = {"message": "The model `nope` does not exist.", "type": "NotFoundError"}
        self.connections = 0
        self.details = "reported"
        self.cut_stream = False
        self.token_ids: list[int] | None = None
        self.tokenize_delay = 0.0
        self.tokenize_requests: list[dict] = []
        self.tokenize_peers: list[int] = []  # the client's port of each /tokenize request
        self.metrics_reads = 0
        self.block_size = 4  # what /metrics says (a vLLM restarted with another --block-size says another)
        self.metrics_status = 200
        self.models: list[dict] | None = [{"id": "tiny", "object": "model", "parent": None}]  # None: 404
        self.models_reads = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_timeout

            def setup(self) -> None:
                super().setup()
                pod.connections += 1

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    pod.metrics_reads += 1
                    data = b'vllm:cache_config_info{block_size="%d",engine="0"} 1.0\n' % pod.block_size
                    self.send_response(pod.metrics_status)
                    self.send_header("content-type", "text/plain; version=0.0.4")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if self.path == "/v1/models":
                    pod.models_reads += 1
                    if pod.models is None:
                        return self._send(404, {"detail": "Not Found"})
                    return self._send(200, {"object": "list", "data": pod.models})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                if self.path == "/tokenize":
                    pod.tokenize_requests.append(json.loads(raw))
                    pod.tokenize_peers.append(self.client_address[1])
                    if pod.token_ids is None:
                        return self._send(404, {"detail": "Not Found"})
                    if pod.token_ids == "unknown model":  # vLLM's own 404: /tokenize exists
                        return self._send(404, {"error": {"message": "The model `x` does not exist.",
                                                          "type": "NotFoundError", "param": None, "code": 404}})
                    time.sleep(pod.tokenize_delay)
                    return self._send(200, {"count": len(pod.token_ids), "max_model_len": 2048,
                                            "tokens": pod.token_ids, "token_strs": None})
                headers = {k.lower(): v for k, v in self.headers.items()}
                pod.requests.append({"raw": raw, "body": json.loads(raw), "headers": headers})
                rid = self.headers.get("x-request-id", "")
                if pod.status != 200:
                    return self._send(pod.status, {"error": {**pod.error, "param": None, "code": pod.status}})
                usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                         "prompt_tokens_details": {"cached_tokens": 4}}
                if pod.details == "null":
                    usage["prompt_tokens_details"] = None
                elif pod.details == "absent":
                    del usage["prompt_tokens_details"]
                elif pod.details == "no_key":
                    usage["prompt_tokens_details"] = {"audio_tokens": 0}
                if not json.loads(raw).get("stream"):
                    return self._send(200, {"id": f"chatcmpl-{rid}", "object": "chat.completion",
                                            "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                 "content": "ok"}}],
                                            "usage": usage, "metrics": {"queue_time_ms": 1.5}})
                chunks = [
                    {"id": f"chatcmpl-{rid}", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                    {"id": f"chatcmpl-{rid}", "choices": [{"index": 0, "delta": {"content": "o"}}]},
                    {"id": f"chatcmpl-{rid}", "choices": [{"index": 0, "delta": {"content": "k"}}]},
                    {"id": f"chatcmpl-{rid}", "choices": [], "usage": usage, "metrics": {"queue_time_ms": 1.5}},
                ]
                self.send_response(200)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                if pod.details == "no_usage":
                    chunks.pop()
                events = [*(f"data: {json.dumps(c)}\n\n" for c in chunks), "data: [DONE]\n\n"]
                for event in events[:3] if pod.cut_stream else events:
                    data = event.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                if pod.cut_stream:
                    self.close_connection = True
                    return
                self.wfile.write(b"0\r\n\r\n")

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_pod():
    pods = []

    def start(**kwargs) -> FakePod:
        pods.append(FakePod(**kwargs))
        return pods[-1]

    yield start
    for pod in pods:
        pod.close()


def test_forwarded_body_and_headers(gateway, fake_pod):
    """What reaches the pod: kvscope metadata removed, include_usage added, X-Request-Id set; the gateway
    hides the usage chunk the client did not ask for but logs its numbers (chunked SSE from the pod)."""
    pod = fake_pod()
    client, log_path = gateway([("fake", pod.url)])
    body = {
        "model": "tiny",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"tenant_id": "acme", "conversation_id": "c1", "prefix_chars": 3, "keep": "me"},
    }
    r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
    rid = r.headers["x-request-id"]
    assert len(rid) == 32  # generated uuid4 hex
    seen = pod.requests[-1]
    assert seen["body"]["metadata"] == {"keep": "me"}
    assert seen["body"]["stream_options"] == {"include_usage": True}
    assert seen["headers"]["x-request-id"] == rid and seen["headers"]["authorization"] == "Bearer k"
    assert "usage" not in r.text and r.text.endswith("data: [DONE]\n\n")
    assert r.text.count("data: ") == 4  # role, "o", "k", [DONE]
    rec = log_line(log_path, rid)
    assert (rec["tenant_id"], rec["conversation_id"]) == ("acme", "c1")
    assert (rec["prompt_tokens"], rec["cached_tokens"], rec["completion_tokens"]) == (7, 4, 2)
    assert rec["queue_wait_ms"] == 1.5 and rec["stream"] is True and rec["error"] == ""
    assert 0 < rec["ttft_ms"] <= rec["e2e_ms"]

    client.post("/v1/chat/completions", json={**body, "metadata": {"tenant_id": "acme"}})
    assert "metadata" not in pod.requests[-1]["body"]


def test_unchanged_body_is_forwarded_as_sent(gateway, fake_pod):
    """A body with nothing to remove or add reaches the pod byte for byte (no re-encoding)."""
    pod = fake_pod()
    client, log_path = gateway([("fake", pod.url)])
    raw = b'{"model":"tiny",  "messages":[{"role":"user","content":"caf\\u00e9 1.50"}], "metadata":{"keep":1}}'
    r = client.post("/v1/chat/completions", content=raw, headers={"X-Request-Id": "gw-raw-1"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-gw-raw-1"
    assert pod.requests[-1]["raw"] == raw
    rec = log_line(log_path, "gw-raw-1")
    assert (rec["prompt_tokens"], rec["cached_tokens"], rec["status"]) == (7, 4, 200)


def test_logged_fingerprints_equal_uncached_ones(gateway, fake_pod):
    """Through the gateway's segment cache, repeated and shared segments log exactly the fingerprint the
    uncached library computes."""
    pod = fake_pod()
    client, log_path = gateway([("fake", pod.url)], policy="prefix_affinity")
    counter = TokenCounter()
    system = {"role": "system", "content": "Now: 2026-11-29T12:00:03Z. " + long_text(300, "cache-eq")}
    turns = [system, {"role": "user", "content": "first"}]
    for i in range(6):
        body = {"model": "tiny", "messages": list(turns), "documents": [{"title": "d", "text": long_text(50, "d")}]}
        rid = f"gw-fp-{i}"
        assert client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid}).status_code == 200
        expected = fingerprint_chat(body, counter).to_log_fields()
        rec = log_line(log_path, rid)
        assert {k: rec[k] for k in expected} == expected
        turns += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"next {i}"}]
    health = client.get("/health").json()
    assert health["segment_cache"]["hits"] > 0 and health["log"]["dropped"] == 0
    assert "kvscope_gateway_log_records_dropped_total" in client.get("/metrics").text


def test_keep_alive_reuse_and_pod_closing_idle_connections(gateway, fake_pod):
    """Requests reuse pooled connections; a connection the pod closed while idle is not used (or is
    retried on a new one), so no request fails."""
    pod = fake_pod(idle_timeout=0.3)
    # precise mode off: its /tokenize call after each answer would overlap the next request on a second connection
    client, log_path = gateway([("fake", pod.url)], block_chain="off")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(5):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert pod.connections == 1
    time.sleep(0.6)  # the pod closes the idle connection
    for _ in range(3):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert pod.connections == 2
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("details", ["null", "absent", "no_key"])
@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_not_reported_are_logged_as_null(gateway, fake_pod, details, stream):
    """A pod that does not report usage.prompt_tokens_details.cached_tokens (vLLM without
    --enable-prompt-tokens-details sends null; forks drop it or the key): cached_tokens null, not 0; the
    prompt count is the pod's (7)."""
    pod = fake_pod()
    pod.details = details
    client, log_path = gateway([("fake-0", pod.url)])
    rid = f"gw-nodetails-{details}-{stream}"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200
    rec = log_line(log_path, rid)
    assert rec["cached_tokens"] is None and rec["prompt_tokens"] == 7 and rec["error"] == ""


@pytest.mark.parametrize("how", ["cut", "no_usage"])
def test_a_stream_without_usage_keeps_the_fingerprint_prompt_count(gateway, fake_pod, how):
    """The pod closes the stream before the usage chunk, or ends it without one: the request stays served with
    the fingerprint's token count (estimate: ceil(400 / 4) system + ceil(40 / 4) user = 110) and cached_tokens
    null; `error` says why."""
    pod = fake_pod()
    pod.cut_stream = how == "cut"
    pod.details = "no_usage" if how == "no_usage" else "reported"
    client, log_path = gateway([("fake-0", pod.url)])
    body = {"model": "tiny", "stream": True, "messages": [{"role": "system", "content": "s" * 400},
                                                           {"role": "user", "content": "q" * 40}]}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": f"gw-{how}-1"}) as r:
            for _ in r.iter_bytes():
                pass
    except httpx.HTTPError:
        pass  # the client sees the broken stream too
    rec = log_line(log_path, f"gw-{how}-1")
    assert (rec["status"], rec["prompt_tokens"], rec["cached_tokens"]) == (200, 110, None)
    assert (rec["system_tokens"], rec["suffix_tokens"], rec["token_count_method"]) == (100, 10, "estimate")
    assert rec["error"].startswith("stream not completed" if how == "cut" else "stream ended without usage")


def test_pod_error_status_is_passed_through(gateway, fake_pod):
    pod = fake_pod()
    pod.status = 404
    client, log_path = gateway([("fake", pod.url)])
    for stream in (False, True):
        rid = f"gw-err-{stream}"
        body = {"model": "nope", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
        r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
        assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
        rec = log_line(log_path, rid)
        assert rec["status"] == 404 and rec["prompt_tokens"] == 0
        assert rec["error"] == "404 NotFoundError: model does not exist" and rec["model"] == "nope"


def test_a_pod_error_quoting_the_prompt_is_logged_scrubbed(gateway, fake_pod):
    """vLLM's validation errors repeat the offending input (here, as vLLM 0.32's handler renders them): the
    client gets the pod's answer unchanged, the log only the type, the status and a fixed phrase."""
    canary = f"canary-{uuid.uuid4().hex}"
    pod = fake_pod()
    pod.status = 400
    pod.error = {"type": "Bad Request", "message": (
        "1 validation error:\n  {'type': 'int_type', 'loc': ('body', 'prompt', 'list[int]', 0), 'msg': 'Input "
        f"should be a valid integer', 'input': '{canary} the secret prompt'}}")}
    client, log_path = gateway([("fake", pod.url)])
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [f"{canary} the secret prompt", 1]},
                    headers={"X-Request-Id": "gw-canary"})
    assert r.status_code == 400 and canary in r.json()["error"]["message"]
    rec = log_line(log_path, "gw-canary")
    assert rec["error"] == "400 Bad Request: request failed validation (1 errors)"
    assert canary not in log_path.read_text()


def _failures(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvscope_gateway_block_chain_failures_total", {"reason": reason}) or 0.0


def _vllm_chain_hex(token_ids: list[int], block_size: int, cache_salt: str = "") -> list[str]:
    """vLLM's default block hash written out (kv_cache_utils.hash_block_tokens with sha256 = SHA-256 of the
    pickle, NONE_HASH = H("vllm-none-hash"), extra keys only a cache_salt's on the first block, as
    generate_block_hash_extra_keys gives them), low 64 bits as 16 hex characters."""
    import hashlib
    import pickle

    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = h("vllm-none-hash"), []
    for i in range(len(token_ids) // block_size):
        keys = (("cache_salt", cache_salt),) if cache_salt and i == 0 else None
        parent = h((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), keys))
        out.append(parent[-8:].hex())
    return out


CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}


def test_the_block_chain_is_logged_after_the_answer_and_never_delays_it(gateway, fake_pod):
    """/tokenize takes 1 s: the client has its answer at once, the line comes after with the chain of the pod's
    7 token ids in blocks of 4 (one full block) and the block size read once from /metrics."""
    pod = fake_pod()
    pod.token_ids, pod.tokenize_delay = [101, 2023, 7, 99, 5, 6, 1], 1.0
    client, log_path = gateway([("pod-0", pod.url)])
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json={**CHAT, "metadata": {"tenant_id": "acme"}},
                    headers={"X-Request-Id": "chain-1"})
    assert r.status_code == 200 and time.monotonic() - t0 < 0.8
    rec = log_line(log_path, "chain-1")
    assert time.monotonic() - t0 >= 1.0
    assert rec["prompt_block_size"] == 4 and rec["prompt_tokens"] == 7
    assert rec["prompt_block_hashes"] == _vllm_chain_hex([101, 2023, 7, 99], 4) != []
    assert pod.tokenize_requests == [CHAT]  # kvscope's metadata is not sent, the chat fields are
    pod.tokenize_delay = 0.0
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"X-Request-Id": "chain-2"})
    assert log_line(log_path, "chain-2")["prompt_block_hashes"] == rec["prompt_block_hashes"]
    assert pod.tokenize_requests[1] == {"model": "tiny", "prompt": "x"}
    assert pod.metrics_reads == 1  # the block size is cached per pod


def _local_tcp_ports(pid: int) -> set[int]:
    """The local ports of process ``pid``'s TCP sockets (its /proc fds matched to /proc/net/tcp's inodes)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_chains_come_from_the_helper_process_and_survive_its_death(tmp_path, fake_pod):
    """The chain work runs in the helper process the gateway started (the pod's /tokenize request comes from one
    of the helper's sockets, not the gateway's); when it dies, the lines it held are logged without a chain and
    the gateway computes later chains itself (from its own sockets)."""
    pod = fake_pod()
    pod.token_ids = [1, 2, 3, 4, 5, 6, 7]
    app = make_app([("pod-0", pod.url)], tmp_path / "g.jsonl")
    with GatewayServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "h-1"})
        assert log_line(tmp_path / "g.jsonl", "h-1")["prompt_block_hashes"] == _vllm_chain_hex([1, 2, 3, 4], 4)
        helper = app.state.gateway.chainer._proc
        assert helper is not None and helper.poll() is None
        helper_ports, own_ports = _local_tcp_ports(helper.pid), _local_tcp_ports(os.getpid())
        assert pod.tokenize_peers[0] in helper_ports and pod.tokenize_peers[0] not in own_ports
        helper.kill()
        helper.wait(10)
        time.sleep(0.2)
        for i in (2, 3):
            client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": f"h-{i}"})
            rec = log_line(tmp_path / "g.jsonl", f"h-{i}")
            assert rec["prompt_block_hashes"] == _vllm_chain_hex([1, 2, 3, 4], 4), i
        assert set(pod.tokenize_peers[1:]) <= _local_tcp_ports(os.getpid())  # the gateway's own, kept alive
    assert len(pod.tokenize_requests) == 3


def test_a_pod_without_tokenize_gets_no_chain_and_each_request_is_counted(gateway, fake_pod):
    pod = fake_pod()  # /tokenize answers 404
    client, log_path = gateway([("pod-0", pod.url)])
    before = _failures("tokenize_unavailable")
    for i in range(3):
        assert client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": f"nt-{i}"}).status_code == 200
        rec = log_line(log_path, f"nt-{i}")
        assert (rec["prompt_block_hashes"], rec["prompt_block_size"]) == ([], 0)
    assert len(pod.tokenize_requests) == 1  # asked once, then left alone for RETRY_SECONDS
    assert _failures("tokenize_unavailable") - before == 3


def test_a_vllm_error_from_tokenize_is_a_failure_not_a_missing_endpoint(gateway, fake_pod):
    """vLLM's 404 for a model it does not serve carries an "error" object: counted as tokenize_failed, and the pod
    is asked again for the next request (a missing route would leave it alone for RETRY_SECONDS)."""
    pod = fake_pod()
    pod.token_ids = "unknown model"
    client, log_path = gateway([("pod-0", pod.url)])
    before = _failures("tokenize_failed")
    for i in range(2):
        client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": f"ve-{i}"})
        assert log_line(log_path, f"ve-{i}")["prompt_block_hashes"] == []
    assert len(pod.tokenize_requests) == 2
    assert _failures("tokenize_failed") - before == 2


def test_token_ids_that_are_not_what_the_pod_prefilled_give_no_chain(gateway, fake_pod):
    """/tokenize says 5 tokens, the pod's usage says 7: the ids are not the prefilled ones; nothing logged."""
    pod = fake_pod()
    pod.token_ids = [1, 2, 3, 4, 5]
    client, log_path = gateway([("pod-0", pod.url)])
    before = _failures("count_mismatch")
    client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "mm-1"})
    assert log_line(log_path, "mm-1")["prompt_block_hashes"] == []
    assert _failures("count_mismatch") - before == 1


def test_block_chain_off_never_asks_the_pod(gateway, fake_pod):
    pod = fake_pod()
    pod.token_ids = [1, 2, 3, 4, 5, 6, 7]
    client, log_path = gateway([("pod-0", pod.url)], block_chain="off")
    client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "off-1"})
    rec = log_line(log_path, "off-1")
    assert (rec["prompt_block_hashes"], rec["prompt_block_size"]) == ([], 0)
    assert pod.tokenize_requests == [] and pod.metrics_reads == 0


def test_a_pod_restarted_with_another_block_size_gets_chains_of_its_new_size(fake_pod, monkeypatch):
    """Found on a real pod restarted from --block-size 32 to 64: the gateway kept the size it read first, so every
    later chain was of the old size and that pod's requests lost precise mode for good. The size is read again
    after BLOCK_SIZE_REFRESH_SECONDS; a read that fails then keeps the size it had. (The chainer in this process:
    the gateway runs it in a helper process, out of monkeypatch's reach.)"""
    import asyncio

    import gateway.block_chain as block_chain
    from gateway.upstream import Timeouts, UpstreamClient

    monkeypatch.setattr(block_chain, "BLOCK_SIZE_REFRESH_SECONDS", 0.3)
    pod = fake_pod()
    chainer = block_chain.BlockChainer({"pod-0": pod.url})

    def size() -> int:
        async def read() -> int:
            client = UpstreamClient(Timeouts(connect=5.0, read=10.0))
            try:
                return await chainer._block_size(client, "pod-0")
            finally:
                await client.aclose()
        return asyncio.run(read())

    assert (size(), pod.metrics_reads) == (4, 1)
    pod.block_size = 2  # the pod restarted with --block-size 2
    assert (size(), pod.metrics_reads) == (4, 1)  # read less than 0.3 s ago
    time.sleep(0.4)
    assert (size(), pod.metrics_reads) == (2, 2)
    pod.metrics_status = 500
    time.sleep(0.4)
    assert (size(), pod.metrics_reads) == (2, 3)  # the refresh failed: the size it had is kept
    assert (size(), pod.metrics_reads) == (2, 3)  # and not read again at once


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_truncated_prompt_logs_no_segments(gateway, fake_pod, endpoint):
    """Found on a real pod: with ``truncate_prompt_tokens`` vLLM prefills only the prompt's last N tokens, but the
    segments were those of the whole body, counted from its start: attribution placed the predecessor's system
    prompt in a prompt that no longer began with it and answered ``evicted`` on a pod that evicted nothing. Such a
    line now has no segments (its causes are ``unknown``), nor a chain; its cache_salt_hash is still logged."""
    pod = fake_pod()
    client, log_path = gateway([("pod-0", pod.url)])
    body = ({**CHAT, "truncate_prompt_tokens": 5} if endpoint == "chat" else
            {"model": "tiny", "prompt": "be brief, hi", "truncate_prompt_tokens": 5})
    r = client.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions", json={**body, "cache_salt": "s"},
                    headers={"X-Request-Id": f"trunc-{endpoint}"})
    assert r.status_code == 200
    rec = log_line(log_path, f"trunc-{endpoint}")
    assert rec["prompt_fingerprint"] == rec["system_hash"] == rec["suffix_hash"] == ""
    assert rec["system_tokens"] == rec["suffix_tokens"] == 0 and rec["prompt_block_hashes"] == []
    assert rec["cache_salt_hash"] != "" and rec["prompt_tokens"] == 7


def test_a_configured_block_size_needs_no_metrics(gateway, fake_pod):
    pod = fake_pod()
    pod.token_ids = [1, 2, 3, 4, 5, 6, 7]
    client, log_path = gateway([("pod-0", pod.url)], block_size=2)
    client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "bs-1"})
    rec = log_line(log_path, "bs-1")
    assert rec["prompt_block_size"] == 2 and rec["prompt_block_hashes"] == _vllm_chain_hex([1, 2, 3, 4, 5, 6], 2)
    assert pod.metrics_reads == 0


def test_concurrent_requests_each_log_one_line_without_pods(gateway, fake_pod):
    from concurrent.futures import ThreadPoolExecutor

    pod = fake_pod()
    client, log_path = gateway([("a", pod.url), ("b", pod.url)], policy="prefix_affinity")

    def one(i: int) -> str:
        rid = f"gw-many-{i}"
        body = {"model": "tiny", "stream": i % 2 == 0, "messages": [{"role": "user", "content": f"q{i}"}]}
        assert client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid}).status_code == 200
        return rid

    with ThreadPoolExecutor(16) as pool:
        rids = list(pool.map(one, range(200)))
    for rid in rids:
        log_line(log_path, rid)
    assert len(log_path.read_text().splitlines()) == 200


def test_prefix_affinity_sends_the_turn_after_an_assistant_prefill_to_the_pod_that_prefilled_it(gateway, fake_pod):
    """The next turn carries the prefill completed (prefill + reply): its parent_fingerprint names the history before
    the user message the prefill answered, so only prefill_parent_fingerprint finds the prefill turn's pod (before
    it the turn was routed as new, "affinity_new", and missed the prefill's blocks on the other pod)."""
    pod = fake_pod()
    client, log_path = gateway([("a", pod.url), ("b", pod.url), ("c", pod.url)], policy="prefix_affinity")
    system = {"role": "system", "content": "You answer order questions."}
    first = [system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
             {"role": "user", "content": "Where is order 1?"}, {"role": "assistant", "content": "Order 1 is"}]
    nxt = [*first[:-1], {"role": "assistant", "content": "Order 1 is on its way."},
           {"role": "user", "content": "When?"}]
    for rid, messages, extra in (("gw-prefill-1", first, {"continue_final_message": True,
                                                            "add_generation_prompt": False}),
                                 ("gw-prefill-2", nxt, {})):
        body = {"model": "tiny", "messages": messages, **extra}
        assert client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid}).status_code == 200
    one, two = log_line(log_path, "gw-prefill-1"), log_line(log_path, "gw-prefill-2")
    assert one["continue_final_message"] is True and one["routing_reason"] == "affinity_new"
    assert (two["routing_reason"], two["pod"]) == ("affinity_hit", one["pod"])


def test_upstream_client_retries_a_connection_closed_under_it_once():
    """The race the idle check cannot see: the pod closes a kept-alive connection just as the next request
    is sent. The gateway's POST goes out again on a new connection (aiohttp itself retries only idempotent
    methods), once: a pod that closes every connection unanswered is an error, a refused one a connect
    error (another pod may be tried)."""
    import asyncio

    from gateway.upstream import UpstreamClient, UpstreamConnectError, UpstreamError

    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    accepted = []

    async def handle(reader, writer):
        accepted.append(writer)
        n = len(accepted)
        served = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [int(x.split(b":")[1]) for x in head.lower().split(b"\r\n") if x.startswith(b"content-length")]
                await reader.readexactly(length[0] if length else 0)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if n == 1 and served == 1 or n >= 3:  # drop the 2nd request on the 1st connection, all from the 3rd
                break
            writer.write(answer)
            served += 1
        writer.close()

    async def scenario():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        client = UpstreamClient()
        results = []
        for _ in range(2):
            response = await client.request("POST", url, [("content-type", "application/json")], b"{}")
            results.append(await response.aread())
            response.close()
        assert results == [b"ok", b"ok"] and len(accepted) == 2  # the 2nd went out again on a new connection
        await client.aclose()
        client = UpstreamClient()  # the 3rd connection closes unanswered, and so does the 4th: an error
        try:
            await client.request("POST", url, [], b"{}")
            raise AssertionError("expected UpstreamError")
        except UpstreamError as exc:
            assert not isinstance(exc, UpstreamConnectError)
        assert len(accepted) == 4
        server.close()
        try:
            await client.request("POST", f"http://127.0.0.1:{free_port()}/v1/completions", [], b"{}")
            raise AssertionError("expected UpstreamConnectError")
        except UpstreamConnectError:
            pass
        await client.aclose()
        assert client.closed

    asyncio.run(scenario())


def test_upstream_client_read_timeouts():
    """No response head within the read timeout, or a stream that stalls between two pieces, is an
    `UpstreamTimeout` (the gateway answers 504 / logs the stream as not completed); the pieces that did
    arrive are passed on with the chunked framing removed."""
    import asyncio

    from gateway.upstream import Timeouts, UpstreamClient, UpstreamTimeout

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        if b"/stall-stream" in head:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"d\r\ndata: first\n\n\r\n")
        await reader.read()  # nothing more (no head at all for /stall-head) until the client gives up
        writer.close()

    async def scenario():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = UpstreamClient(Timeouts(connect=1.0, read=0.3))
        t0 = time.monotonic()
        try:
            await client.request("POST", base + "/stall-head", [], b"{}")
            raise AssertionError("expected UpstreamTimeout")
        except UpstreamTimeout:
            pass
        assert 0.25 < time.monotonic() - t0 < 2
        response = await client.request("POST", base + "/stall-stream", [], b"{}")
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        pieces = []
        try:
            async for piece in response.aiter_bytes():
                pieces.append(piece)
            raise AssertionError("expected UpstreamTimeout")
        except UpstreamTimeout:
            pass
        response.close()
        assert b"".join(pieces) == b"data: first\n\n"
        await client.aclose()
        server.close()
        await asyncio.sleep(0.05)  # the handlers see the connections close

    asyncio.run(scenario())


def test_gateway_closes_its_upstream_client_on_shutdown(tmp_path, fake_pod):
    pod = fake_pod()
    app = make_app([("fake", pod.url)], tmp_path / "gateway.jsonl")
    with GatewayServer(app) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200
        client = app.state.gateway.client
        assert not client.closed
    assert client.closed


# --- real vLLM --------------------------------------------------------------------------------------------


def pods_of(fleet) -> list[tuple[str, str]]:
    return [(pod.name, pod.base_url) for pod in fleet.pods]


def chat_body(prefix_seed: str, question: str = "What now?", n_words: int = 300, **extra) -> dict:
    return {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": long_text(n_words, prefix_seed)},
            {"role": "user", "content": question},
        ],
        **extra,
    }


def assert_usage_logged(rec: dict, usage: dict) -> None:
    assert rec["prompt_tokens"] == usage["prompt_tokens"] > 0
    assert rec["cached_tokens"] == (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    assert rec["completion_tokens"] == usage["completion_tokens"]
    assert 0 <= rec["ttft_ms"] <= rec["e2e_ms"]


@pytest.mark.vllm
def test_chat_non_streaming_passthrough_and_request_id(vllm_fleet, tiny_model_dir, gateway):
    client, log_path = gateway(pods_of(vllm_fleet)[:1], tokenizer_path=tiny_model_dir)
    rid = f"gw-chat-{uuid.uuid4().hex[:8]}"
    body = chat_body(rid)
    r = client.post(
        "/v1/chat/completions", json=body, headers={"X-Request-Id": rid, "X-Conversation-Id": "conv-1"}
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["id"] == f"chatcmpl-{rid}" and r.headers["x-request-id"] == rid
    assert data["choices"][0]["message"]["role"] == "assistant"
    rec = log_line(log_path, rid)
    assert_usage_logged(rec, data["usage"])
    assert rec["pod"] == vllm_fleet.pods[0].name and rec["routing_reason"] == "round_robin"
    assert rec["conversation_id"] == "conv-1" and rec["endpoint"] == "chat.completions"
    assert rec["stream"] is False and rec["status"] == 200 and rec["error"] == ""
    assert rec["token_count_method"] == "tokenizer"
    expected = fingerprint_chat(body, TokenCounter(tiny_model_dir))
    assert {k: rec[k] for k in expected.to_log_fields()} == expected.to_log_fields()
    # segment tokens exclude the chat template, so they sum to at most the prompt
    assert rec["system_tokens"] + rec["suffix_tokens"] <= rec["prompt_tokens"]


@pytest.mark.vllm
@pytest.mark.parametrize("client_wants_usage", [False, True])
def test_chat_streaming_passthrough(vllm_fleet, gateway, client_wants_usage):
    client, log_path = gateway(pods_of(vllm_fleet)[:1])
    rid = f"gw-stream-{uuid.uuid4().hex[:8]}"
    body = chat_body(rid, stream=True)
    if client_wants_usage:
        body["stream_options"] = {"include_usage": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["id"] == f"chatcmpl-{rid}" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    usage_chunks = [c for c in chunks if c.get("usage")]
    rec = log_line(log_path, rid)
    if client_wants_usage:
        assert len(usage_chunks) == 1
        assert_usage_logged(rec, usage_chunks[0]["usage"])
    else:
        assert usage_chunks == []  # the chunk the gateway asked for is not shown to the client
        assert rec["prompt_tokens"] > 0 and rec["completion_tokens"] > 0
    assert rec["stream"] is True and rec["status"] == 200 and rec["error"] == ""
    assert 0 < rec["ttft_ms"] <= rec["e2e_ms"]


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True])
def test_completions_passthrough(vllm_fleet, gateway, stream):
    client, log_path = gateway(pods_of(vllm_fleet)[:1])
    rid = f"gw-cmpl-{uuid.uuid4().hex[:8]}"
    stable = long_text(200, rid) + "\n"
    body = {
        "model": "tiny",
        "prompt": stable + "Question: what now?",
        "max_tokens": 4,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "metadata": {"prefix_chars": len(stable), "tenant_id": "acme"},
    }
    body = {k: v for k, v in body.items() if v is not None}
    r = client.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [
            json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e.startswith("data: {")
        ]
        usage = [c for c in chunks if c.get("usage")][-1]["usage"]
        assert chunks[0]["id"] == f"cmpl-{rid}"
    else:
        usage = r.json()["usage"]
        assert r.json()["id"] == f"cmpl-{rid}"
    rec = log_line(log_path, rid)
    assert_usage_logged(rec, usage)
    assert rec["endpoint"] == "completions" and rec["tenant_id"] == "acme"
    assert rec["system_hash"] and rec["prompt_fingerprint"] and rec["suffix_hash"]


def engine_counters(metrics_url: str) -> dict[str, float]:
    """Σ over engines and labels of vLLM's finished requests and prefix-cache queries, read from one pod's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"vllm:request_success_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for fam in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in fam.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def counted(metrics_url: str, before: dict[str, float], finished: int) -> dict[str, float]:
    """The increase of :func:`engine_counters` since ``before``, once vLLM has counted ``finished`` more finished
    requests (it updates its counters from the engine's stats a moment after the response; at most 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        now = engine_counters(metrics_url)
        delta = {k: now[k] - before[k] for k in now}
        if delta["vllm:request_success_total"] >= finished or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


@pytest.mark.vllm
def test_a_request_vllm_runs_as_several_sequences_logs_its_cached_count_as_unknown(vllm_fleet, gateway):
    """Found on real pods by a hostile hunt: with n = 2 a never-seen prompt came back with most of it "cached" (the
    second sample hit the blocks the first had just computed), and a completions list of two prompts reports the
    tokens of both but the cached count of the last alone. vLLM's count is not the prompt's hit count there: the
    gateway logs it as unknown (null, so `not_reported`), and the pod's own usage stays as vLLM sent it. It logs how
    many engine requests vLLM ran (engine_requests): the pod's finished requests rise by exactly that many, and its
    prefix-cache queries by each one's prompt (the data-quality check compares the two sources on it)."""
    pod = pods_of(vllm_fleet)[0]
    metrics_url = f"{pod[1]}/metrics"
    client, log_path = gateway([pod], policy="round_robin")
    seed = f"gw-nseq-{uuid.uuid4().hex[:8]}"
    body = {**chat_body(seed, n_words=300), "n": 2, "max_tokens": 2}
    before = engine_counters(metrics_url)
    r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": f"{seed}-n2"})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    print(f"\nn=2 on a new prompt: vLLM usage {usage}")
    assert len(r.json()["choices"]) == 2
    rec = log_line(log_path, f"{seed}-n2")
    assert rec["prompt_tokens"] == usage["prompt_tokens"] and rec["cached_tokens"] is None
    assert rec["engine_requests"] == 2
    delta = counted(metrics_url, before, 2)
    print(f"n=2: vLLM counted {delta}")
    assert delta == {"vllm:request_success_total": 2, "vllm:prefix_cache_queries_total": 2 * usage["prompt_tokens"]}
    prompts = [f"{seed} document {i}: " + " ".join(f"fact {j} of {i}." for j in range(120)) for i in range(2)]
    for i in range(2):
        before = engine_counters(metrics_url)
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 1},
                        headers={"X-Request-Id": f"{seed}-batch-{i}"})
        assert r.status_code == 200, r.text
        rec = log_line(log_path, f"{seed}-batch-{i}")
        assert rec["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] and rec["cached_tokens"] is None
        assert rec["engine_requests"] == 2
        assert counted(metrics_url, before, 2) == {"vllm:request_success_total": 2,
                                                   "vllm:prefix_cache_queries_total": rec["prompt_tokens"]}
    print(f"two prompts, repeated: vLLM usage {r.json()['usage']}")  # cached: the last prompt's alone
    one = {"model": "tiny", "prompt": prompts[0], "max_tokens": 1}  # one prompt: its count is logged
    r = client.post("/v1/completions", json=one, headers={"X-Request-Id": f"{seed}-single"})
    assert r.status_code == 200, r.text
    rec = log_line(log_path, f"{seed}-single")
    assert rec["cached_tokens"] == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert rec["engine_requests"] == 1


@pytest.mark.vllm
def test_repeated_long_prompt_is_cached(vllm_fleet, gateway):
    client, log_path = gateway(pods_of(vllm_fleet), policy="prefix_affinity")
    seed = f"gw-repeat-{uuid.uuid4().hex[:8]}"
    records = []
    for i in range(2):
        rid = f"{seed}-{i}"
        r = client.post(
            "/v1/chat/completions",
            json=chat_body(seed, n_words=400),
            headers={"X-Request-Id": rid, "X-Agent-Run-Id": seed},
        )
        assert r.status_code == 200, r.text
        rec = log_line(log_path, rid)
        assert_usage_logged(rec, r.json()["usage"])
        records.append(rec)
        time.sleep(0.2)
    first, second = records
    assert first["routing_reason"] == "affinity_new" and second["routing_reason"] == "affinity_hit"
    assert second["pod"] == first["pod"]
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] > 0.8 * second["prompt_tokens"]
    assert first["prompt_fingerprint"] == second["prompt_fingerprint"] != ""
    assert first["tool_latency_ms"] is None and second["tool_latency_ms"] >= 150


@pytest.mark.vllm
def test_round_robin_sends_the_repeat_elsewhere(vllm_fleet, gateway):
    assert len(vllm_fleet.pods) >= 2, "the session fleet has two pods"
    client, log_path = gateway(pods_of(vllm_fleet)[:2], policy="round_robin")
    seed = f"gw-rr-{uuid.uuid4().hex[:8]}"
    recs = []
    for i in range(2):
        rid = f"{seed}-{i}"
        assert client.post(
            "/v1/chat/completions", json=chat_body(seed), headers={"X-Request-Id": rid}
        ).is_success
        recs.append(log_line(log_path, rid))
    assert recs[0]["pod"] != recs[1]["pod"]
    assert recs[1]["cached_tokens"] == 0  # the other pod never saw the prefix: routed away


@pytest.mark.vllm
def test_failover_from_unreachable_pod(vllm_fleet, gateway):
    pods = [("dead-0", f"http://127.0.0.1:{free_port()}"), pods_of(vllm_fleet)[0]]
    client, log_path = gateway(pods, policy="round_robin")
    rid = f"gw-failover-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/chat/completions", json=chat_body(rid, n_words=20), headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    rec = log_line(log_path, rid)
    assert rec["pod"] == vllm_fleet.pods[0].name and rec["routing_reason"] == "pod_down"
    assert rec["pods_down"] == ["dead-0"]
    # the dead pod stays marked down: the next request skips it, and its log line still names it
    rid2 = f"{rid}-next"
    assert client.post("/v1/chat/completions", json=chat_body(rid, n_words=20), headers={"X-Request-Id": rid2}
                       ).status_code == 200
    later = log_line(log_path, rid2)
    assert later["pod"] == vllm_fleet.pods[0].name and later["pods_down"] == ["dead-0"]


@pytest.mark.vllm
def test_pod_error_is_passed_through_and_logged(vllm_fleet, gateway):
    client, log_path = gateway(pods_of(vllm_fleet)[:1])
    rid = f"gw-404-{uuid.uuid4().hex[:8]}"
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 404
    assert "no-such-model" in r.json()["error"]["message"]
    rec = log_line(log_path, rid)
    assert rec["status"] == 404 and rec["prompt_tokens"] == 0 and rec["model"] == "no-such-model"
    assert rec["error"] == "404 NotFoundError: model does not exist"  # the quoted name is not copied


@pytest.mark.vllm
def test_models_and_health(vllm_fleet, gateway):
    client, _ = gateway(pods_of(vllm_fleet))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    health = client.get("/health").json()
    assert [p["name"] for p in health["pods"]] == [p.name for p in vllm_fleet.pods]


@pytest.mark.vllm
def test_concurrent_requests_each_log_one_line(vllm_fleet, gateway):
    from concurrent.futures import ThreadPoolExecutor

    client, log_path = gateway(pods_of(vllm_fleet), policy="prefix_affinity", max_inflight_per_pod=2)
    seed = f"gw-conc-{uuid.uuid4().hex[:8]}"

    def one(i: int) -> str:
        rid = f"{seed}-{i}"
        body = chat_body(seed, question=f"q{i}", stream=i % 2 == 0)
        r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
        assert r.status_code == 200, r.text
        return rid

    with ThreadPoolExecutor(8) as pool:
        rids = list(pool.map(one, range(16)))
    records = [log_line(log_path, rid) for rid in rids]
    assert {r["routing_reason"] for r in records} <= {"affinity_new", "affinity_hit", "load_guard"}
    assert len(log_path.read_text().splitlines()) == 16
    deadline = time.monotonic() + 5
    while any(p["inflight"] for p in client.get("/health").json()["pods"]):
        assert time.monotonic() < deadline, "in-flight counts did not return to 0"
        time.sleep(0.05)


def running_requests(pod) -> float:
    """vllm:num_requests_running of a fleet pod, from its /metrics (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(pod.metrics_url, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running")


def read_first_event_and_reset(url: str, body: dict, request_id: str) -> bytes:
    """POST `body` as a streaming chat request over a raw socket, read up to the end of the first SSE event,
    then close with a TCP reset (SO_LINGER 0): the client is gone at once, with no buffered close of an HTTP
    library in between. The socket's receive buffer is set small before it connects (a small TCP window), so
    a pod that answers in one burst cannot have its whole answer taken off the gateway's hands before the
    reset (on loopback the window otherwise grows to megabytes). Returns the first event."""
    import socket
    import struct
    from urllib.parse import urlsplit

    u = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
            f"Content-Type: application/json\r\nX-Request-Id: {request_id}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect((u.hostname, u.port))
        sock.sendall(head + payload)
        got = b""
        while b"data:" not in got or not got.split(b"data:", 1)[1].count(b"\n\n"):
            part = sock.recv(65536)
            assert part, f"the gateway closed before the first event: {got[:300]!r}"
            got += part
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return got


@pytest.mark.vllm
def test_client_disconnect_mid_stream_still_logs(vllm_fleet, gateway):
    """The client reads the first SSE event of a 3,000-token answer and goes (a TCP reset): the line says the
    stream was not completed. vLLM on CPU may still be generating for an earlier aborted request and then send
    a whole answer at once, before the disconnect reaches the gateway (which then did deliver every byte: a
    completed stream, rightly logged so, and checked as such). So the request is sent once the pod is idle,
    and sent again (new id) when vLLM finished it first; the disconnect must be seen within 5 tries."""
    pod = vllm_fleet.pods[0]
    client, log_path = gateway(pods_of(vllm_fleet)[:1])
    completed = []
    for _attempt in range(5):
        deadline = time.monotonic() + 120
        while running_requests(pod) > 0:
            assert time.monotonic() < deadline, "the pod never went idle"
            time.sleep(0.5)
        rid = f"gw-gone-{uuid.uuid4().hex[:8]}"
        body = chat_body(rid, n_words=20, stream=True, max_tokens=3000, ignore_eos=True)
        first = read_first_event_and_reset(str(client.base_url), body, rid)
        assert b" 200 " in first.split(b"\r\n", 1)[0]
        rec = log_line(log_path, rid, timeout_seconds=60)
        assert rec["status"] == 200
        if rec["completion_tokens"] != 3000:  # not delivered whole before the disconnect
            break
        assert rec["error"] == "", rec  # delivered whole: a completed stream
        completed.append(rid)
    print(f"\nattempts delivered whole before the reset reached the gateway: {len(completed)}")
    assert rec["error"].startswith("stream not completed"), rec
    # the usage chunk never came, but vLLM prefilled the prompt: the fingerprint's estimate (no tokenizer:
    # ceil(chars / 4) per message; "What now?" is 9 characters) and an unknown cached count
    system = body["messages"][0]["content"]
    assert (rec["prompt_tokens"], rec["cached_tokens"]) == (math.ceil(len(system) / 4) + 3, None)


def test_a_lora_adapters_chain_is_rooted_at_the_adapter(gateway, fake_pod):
    """vLLM never shares KV blocks between a LoRA adapter and its base model (it keys the adapter into every block).
    A request the pod served with an adapter (its /v1/models lists it with a parent) gets the chain rooted at the
    adapter (kvscope.block_hash.chain_root, as the collector roots the adapter's BlockStored blocks); the base model
    keeps vLLM's chain. An adapter loaded later is found by reading /v1/models again; a name the list still lacks
    gets no chain (model_unknown); a pod without /v1/models serves no adapters."""
    from kvscope.block_hash import chain_hashes

    pod = fake_pod()
    pod.token_ids = [101, 2023, 7, 99, 5, 6, 1]  # the pod's 7 prompt tokens: one full block of 4
    pod.models = [{"id": "tiny", "parent": None}, {"id": "ad-1", "parent": "tiny", "root": "/adapters/ad-1"}]
    client, log_path = gateway([("pod-0", pod.url)])

    def chain_of(rid: str, model: str) -> list[str]:
        assert client.post("/v1/chat/completions", json={**CHAT, "model": model},
                           headers={"X-Request-Id": rid}).status_code == 200
        return log_line(log_path, rid)["prompt_block_hashes"]

    def hexes(lora: str | None) -> list[str]:
        return [f"{h:016x}" for h in chain_hashes(pod.token_ids, 4, lora_name=lora)]

    assert chain_of("base-1", "tiny") == _vllm_chain_hex(pod.token_ids, 4) == hexes(None)
    assert chain_of("lora-1", "ad-1") == hexes("ad-1") != hexes(None)
    assert pod.models_reads == 1
    pod.models.append({"id": "ad-2", "parent": "tiny"})  # loaded at run time
    assert chain_of("lora-2", "ad-2") in ([], hexes("ad-2"))  # [] while the list read last is too recent
    time.sleep(MODELS_REFRESH_SECONDS + 0.5)  # then the list is read again and the adapter found
    assert chain_of("lora-3", "ad-2") == hexes("ad-2")
    assert pod.models_reads == 2
    assert len({tuple(hexes(x)) for x in (None, "ad-1", "ad-2")}) == 3

    other = fake_pod()
    other.token_ids, other.models = pod.token_ids, None  # not vLLM: no /v1/models
    client2, log2 = gateway([("pod-1", other.url)])
    assert client2.post("/v1/chat/completions", json={**CHAT, "model": "ad-1"},
                        headers={"X-Request-Id": "plain-1"}).status_code == 200
    assert log_line(log2, "plain-1")["prompt_block_hashes"] == hexes(None)


def test_a_cache_salt_is_forwarded_logged_only_as_its_hash_and_salts_the_chain(gateway, fake_pod):
    """A chat request with a cache_salt: the pod gets the salt as sent, /tokenize does not; the line has
    cache_salt_hash (not the salt: it can be a per-user secret, and it is nowhere in the log file), a salted
    fingerprint, and the chain vLLM computes with the salt keyed into the first block. Another salt and no salt
    give other fingerprints and chains; a body the fingerprint cannot read keeps its hash."""
    from gateway.fingerprint import hash_parts

    pod = fake_pod()
    pod.token_ids = [101, 2023, 7, 99, 5, 6, 1]  # the pod's 7 prompt tokens: one full block of 4
    client, log_path = gateway([("pod-0", pod.url)])
    secret = "tenant-9-Zq81"
    sent = [("salt-a1", secret), ("salt-a2", secret), ("salt-b", "other"), ("salt-none", None)]
    for rid, salt in sent:
        body = CHAT if salt is None else {**CHAT, "cache_salt": salt}
        assert client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid}).status_code == 200
        assert pod.requests[-1]["body"].get("cache_salt") == salt
    recs = {rid: log_line(log_path, rid) for rid, _ in sent}
    assert all(r == CHAT for r in pod.tokenize_requests)
    a1, a2, b, none = (recs[rid] for rid, _ in sent)
    assert a1["cache_salt_hash"] == a2["cache_salt_hash"] == hash_parts("cache_salt", secret)
    assert b["cache_salt_hash"] == hash_parts("cache_salt", "other") and none["cache_salt_hash"] == ""
    assert a1["prompt_block_hashes"] == a2["prompt_block_hashes"] == _vllm_chain_hex(pod.token_ids, 4, secret)
    assert b["prompt_block_hashes"] == _vllm_chain_hex(pod.token_ids, 4, "other")
    assert none["prompt_block_hashes"] == _vllm_chain_hex(pod.token_ids, 4)
    chains = [a1["prompt_block_hashes"], b["prompt_block_hashes"], none["prompt_block_hashes"]]
    assert len({tuple(c) for c in chains}) == 3 and len(chains[0]) == 1
    assert a1["prompt_fingerprint"] == a2["prompt_fingerprint"]
    assert len({a1["prompt_fingerprint"], b["prompt_fingerprint"], none["prompt_fingerprint"]}) == 3
    assert a1["system_hash"] == none["system_hash"]  # raw segment hashes stay unsalted
    client.post("/v1/chat/completions", json={"model": "tiny", "messages": "not a list", "cache_salt": secret},
                headers={"X-Request-Id": "salt-unread"})
    unread = log_line(log_path, "salt-unread")
    assert unread["cache_salt_hash"] == a1["cache_salt_hash"] and unread["prompt_fingerprint"] == ""
    assert secret not in log_path.read_text()
    for rec in (*recs.values(), unread):
        validate(rec)


def test_the_gateway_runs_on_uvloop_and_httptools(tmp_path):
    """uvicorn's loop="auto" / http="auto" take uvloop and httptools when installed (~20 % less gateway CPU a
    request than asyncio and h11, docs/scale.md); they are dependencies, so an install has them."""
    import sys
    import tomllib

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(";")[0].split(">")[0].split("=")[0].strip() for d in deps}
    assert {"uvloop", "httptools"} <= names
    with GatewayServer(make_app([("dead-0", f"http://127.0.0.1:{free_port()}")], tmp_path / "g.jsonl")) as srv:
        assert srv._server.config.http_protocol_class.__name__ == "HttpToolsProtocol"
        loop = srv._server.servers[0].get_loop()
        assert type(loop).__module__.startswith("uvloop") or sys.platform == "win32"


@pytest.mark.vllm
def test_over_long_client_ids_and_model_still_give_a_line_the_contract_takes(vllm_fleet, gateway):
    """A client's X-Request-Id or X-Tenant-Id of 600 characters was written as is: the log contract refuses names over
    512 characters, so the served request became a dead letter (found on a real pod). Such a value is now fitted
    (gateway.proxy.fit_name): 495 characters, ``~`` and a hash, so two long ids stay two; a short one is unchanged."""
    client, log_path = gateway(pods_of(vllm_fleet)[:1])
    base = "r" * 600
    ids = [base + "-a", base + "-b"]
    for rid in ids:
        r = client.post("/v1/chat/completions", json=chat_body(rid), headers={"X-Request-Id": rid,
                                                                             "X-Tenant-Id": "t" * 600})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == fit_name(rid) and r.json()["id"] == f"chatcmpl-{fit_name(rid)}"
    r = client.post("/v1/chat/completions", json={**chat_body("m"), "model": "m" * 600},
                    headers={"X-Request-Id": "short-id"})
    assert r.status_code == 404
    fitted = [fit_name(rid) for rid in ids]
    assert NAME_MAX_CHARS == CONTRACT_NAME_MAX_CHARS
    assert len(set(fitted)) == 2 and all(len(f) == 512 and f.startswith("r" * 495) for f in fitted)
    recs = [log_line(log_path, f) for f in fitted] + [log_line(log_path, "short-id")]
    assert [len(rec["tenant_id"]) for rec in recs] == [512, 512, 0] and len(recs[2]["model"]) == 512
    envelopes = read_file(log_path)  # the collector's reader: every line is a request, none a dead letter
    logged = sorted(e.payload.record["request_id"] for e in envelopes if e.schema == "gateway_request")
    assert logged == [*fitted, "short-id"]
    assert [e for e in envelopes if e.schema != "gateway_request"] == []
