"""Reference gateway: an OpenAI-compatible reverse proxy in front of vLLM pods that writes the fingerprint
log (client → gateway → vLLM pod; gateway → log file → collector).

Per request it fingerprints the prompt (`gateway.fingerprint`), picks a pod (`gateway.routing`), forwards
the body (kvscope's `metadata` keys removed; streams get `stream_options.include_usage`), passes the
response through unchanged, reads vLLM's usage (`usage.prompt_tokens`,
`usage.prompt_tokens_details.cached_tokens` with `--enable-prompt-tokens-details`, else logged as null;
`metrics.queue_time_ms` with `--enable-per-request-metrics`; vLLM 0.32
`entrypoints/openai/chat_completion/serving.py`), and queues exactly one log line
(`gateway.log.BackgroundLogWriter`), also for errors (whose `error` field holds the type, status and a
scrubbed message, never the pod's text: `gateway.error_text`). A stream that ends without its usage chunk is
logged with the fingerprint's token count as its prompt and a null cached count. vLLM's `cache_salt` request field
is forwarded as sent and logged only as its hash (`cache_salt_hash`, `gateway.fingerprint.cache_salt_hash`): it
can be a per-user secret.

Precise mode (`gateway.block_chain`): once the pod has answered, a task has the helper process
(`gateway.chain_worker`) ask that pod's /tokenize for the prompt's token ids and hash its blocks, then logs the
line with its block chain (`prompt_block_hashes`, `prompt_block_size`); the client's response never waits for
it, and a failure only leaves the chain empty.

Per-request costs are kept off the hot path: segment results are memoized by content
(`gateway.fingerprint.SegmentCache`), the log line is encoded and written by a background thread, the
pods are reached through one keep-alive pool (aiohttp, `gateway.upstream`), and a body whose metadata
needs no change is forwarded as received, not re-encoded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute

from gateway.block_chain import FAILURES as CHAIN_FAILURES
from gateway.block_chain import MAX_PENDING, BlockChainer
from gateway.chain_worker import RemoteChainer
from gateway.error_text import gateway_error, pod_error
from gateway.fingerprint import (
    Endpoint,
    FingerprintError,
    PromptFingerprint,
    SegmentBudgetExceeded,
    SegmentCache,
    TokenCounter,
    cache_salt_hash,
    continues_final_message,
    engine_requests,
    fingerprint_request,
    salted,
    skips_prefix_cache,
)
from gateway.log import BackgroundLogWriter, format_ts
from gateway.routing import NoPodAvailable, make_router
from gateway.upstream import (
    Timeouts,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    pod_url,
)

log = logging.getLogger("kvscope.gateway")

# Body `metadata` keys that are kvscope's and never reach vLLM (vLLM 0.32 accepts and ignores unknown
# request fields, `entrypoints/serve/engine/protocol.py OpenAIBaseModel`, so other metadata passes).
KVSCOPE_METADATA_KEYS = ("tenant_id", "conversation_id", "agent_run_id", "prefix_chars")
# Request headers not forwarded: hop-by-hop (RFC 9110 §7.6.1), recomputed ones, and the id we set ourselves.
_DROP_REQUEST_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "accept-encoding",
        "x-request-id",
    }
)
# Request headers that name the log's ids, by field
_ID_HEADERS = {name: "x-" + name.replace("_", "-") for name in ("tenant_id", "conversation_id", "agent_run_id")}
#: The longest identifier the log contract takes (gateway_log.v1.schema.json ``maxLength`` of request_id, tenant_id,
#: conversation_id, agent_run_id, model), in characters.
NAME_MAX_CHARS = 512


def fit_name(value: str) -> str:
    """``value`` when it has at most :data:`NAME_MAX_CHARS` characters; else its first 495 characters, ``~`` and 16
    hex digits of its SHA-256 (512 in all): a client's over-long id, tenant or model still gives a line the log
    contract takes (a longer one was a dead letter: the served request was lost), and two long values stay two."""
    if len(value) <= NAME_MAX_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return value[:NAME_MAX_CHARS - 17] + "~" + digest
# json.dumps(body, ensure_ascii=False) without building an encoder per request
_encode_body = json.JSONEncoder(ensure_ascii=False).encode
# Generations can queue for minutes under load; connecting should be quick (a refused connect is retried).
UPSTREAM_TIMEOUT = Timeouts(connect=5.0, read=600.0)
TURN_MAP_SIZE = 100_000
# Uncached segment text (characters) fingerprinted on the event loop; more goes to a worker thread so a
# long new prompt (30 ms to tokenize 30k tokens) does not stall every other request. About 1 ms of work.
INLINE_FINGERPRINT_BUDGET = 8_000


def _error_body(message: str, status: int) -> dict[str, Any]:
    """OpenAI-style error object, as vLLM returns it."""
    return {"error": {"message": message, "type": "GatewayError", "param": None, "code": status}}


class TurnGaps:
    """Per agent_run_id (else conversation_id): when its last request ended, for `tool_latency_ms`.

    Bounded LRU of `max_entries` keys; times from `time.monotonic()` in seconds. Thread safe."""

    def __init__(self, max_entries: int = TURN_MAP_SIZE) -> None:
        self._ends: OrderedDict[str, float] = OrderedDict()
        self._inflight: dict[str, int] = {}
        self._lock = threading.Lock()
        self.max_entries = max_entries

    @staticmethod
    def key(agent_run_id: str, conversation_id: str) -> str:
        if agent_run_id:
            return f"run:{agent_run_id}"
        return f"conv:{conversation_id}" if conversation_id else ""

    def arrive(self, key: str, now: float) -> float | None:
        """Gap in ms since the key's previous request ended; None for a first turn, no key, or when another
        request of the key is still in flight (no client-side wait to measure)."""
        if not key:
            return None
        with self._lock:
            busy = self._inflight.get(key, 0) > 0
            self._inflight[key] = self._inflight.get(key, 0) + 1
            end = self._ends.get(key)
        return None if busy or end is None else round(max(now - end, 0.0) * 1000, 3)

    def leave(self, key: str, now: float) -> None:
        if not key:
            return
        with self._lock:
            left = self._inflight.get(key, 1) - 1
            if left > 0:
                self._inflight[key] = left
            else:
                self._inflight.pop(key, None)
            self._ends[key] = now
            self._ends.move_to_end(key)
            while len(self._ends) > self.max_entries:
                self._ends.popitem(last=False)


@dataclass
class _Exchange:
    """What the log line of one request needs, filled in as the request goes."""

    request_id: str
    arrival_wall: float  # unix seconds
    arrival: float  # time.monotonic() seconds
    endpoint: Endpoint
    routing_policy: str
    fingerprint: PromptFingerprint
    tenant_id: str = ""
    conversation_id: str = ""
    agent_run_id: str = ""
    turn_key: str = ""
    model: str = ""
    stream: bool = False
    pod: str = ""
    routing_reason: str = ""
    pods_down: tuple[str, ...] = ()  # the pods found down when this one was chosen (gateway.routing.Route)
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the pod did not report it (logged as null, never as 0)
    completion_tokens: int = 0
    usage_seen: bool = False  # a usage object arrived from the pod
    first_token: float | None = None  # monotonic seconds
    queue_wait_ms: float | None = None
    tool_latency_ms: float | None = None
    done: bool = False  # the upstream stream was read to its end
    holds_pod: bool = False  # counted in the router's in-flight count of `pod`
    logged: bool = False
    body: dict[str, Any] | None = None  # the request body, for its block chain (gateway.block_chain)
    skip_reading_prefix_cache: bool = False  # vLLM reads no prefix cache (gateway.fingerprint.skips_prefix_cache)
    continue_final_message: bool = False  # an assistant prefill vLLM continues (gateway.fingerprint)
    engine_requests: int = 1  # n × prompts (gateway.fingerprint); above 1 the cached count is logged null

    def read_usage(self, payload: Mapping[str, Any]) -> None:
        """Take usage and per-request metrics from a response body or stream chunk, when present.

        ``cached_tokens`` is the pod's ``usage.prompt_tokens_details.cached_tokens`` when it is there, else None
        (vLLM without --enable-prompt-tokens-details sends ``prompt_tokens_details: null``; forks may drop the
        key): an unreported count is unknown, not 0."""
        usage = payload.get("usage")
        if isinstance(usage, Mapping):
            self.usage_seen = True
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
            self.cached_tokens = None if cached is None else int(cached)
        metrics = payload.get("metrics")
        if isinstance(metrics, Mapping) and metrics.get("queue_time_ms") is not None:
            self.queue_wait_ms = round(float(metrics["queue_time_ms"]), 3)

    def record(self, now: float) -> dict[str, Any]:
        e2e_ms = round((now - self.arrival) * 1000, 3)
        ttft_ms = e2e_ms if self.first_token is None else round((self.first_token - self.arrival) * 1000, 3)
        return {
            "request_id": self.request_id,
            "ts": format_ts(self.arrival_wall),
            "tenant_id": self.tenant_id,
            "conversation_id": self.conversation_id,
            "agent_run_id": self.agent_run_id,
            "model": self.model,
            "pod": self.pod,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "routing_policy": self.routing_policy,
            "routing_reason": self.routing_reason,
            "pods_down": list(self.pods_down),
            "status": self.status,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": None if self.engine_requests > 1 else self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": ttft_ms,
            "e2e_ms": e2e_ms,
            "queue_wait_ms": self.queue_wait_ms,
            "tool_latency_ms": self.tool_latency_ms,
            "skip_reading_prefix_cache": self.skip_reading_prefix_cache,
            "continue_final_message": self.continue_final_message,
            "engine_requests": self.engine_requests,
            **self.fingerprint.to_log_fields(),
            "prompt_block_hashes": [],  # filled in by Gateway._log_with_chain when the chain is known
            "prompt_block_size": 0,
        }


def _has_content(chunk: Mapping[str, Any]) -> bool:
    """Whether a stream chunk carries generated output (chat delta content/reasoning/tool calls, or
    completion text); vLLM's first chat chunk carries only the role."""
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, Mapping) and any(
            delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")
        ):
            return True
    return False


class _Logged:
    """Mixin for a Response: calls `on_done(exc)` once after sending (or failing to send) the body, then
    closes `upstream` (closing an unfinished stream makes vLLM abort the generation once it notices the
    disconnect: on the CPU build it went on generating for up to ~10 s, so the pod stays busy that long)."""

    on_done: Callable[[BaseException | None], None]
    upstream: UpstreamResponse

    async def __call__(self, scope, receive, send) -> None:
        exc: BaseException | None = None
        try:
            await super().__call__(scope, receive, send)  # type: ignore[misc]
        except BaseException as e:
            exc = e
            raise
        finally:
            # both synchronous: the line is queued and the connection released even when this task is being
            # cancelled
            self.on_done(exc)
            self.upstream.close()


class _LoggedResponse(_Logged, Response):
    pass


class _LoggedStreamingResponse(_Logged, StreamingResponse):
    pass


class Gateway:
    """State shared by the routes: pods, router, token counter, segment cache, log writer, upstream pool."""

    def __init__(
        self,
        pods: list[tuple[str, str]],
        log_path: Path,
        policy: str,
        tokenizer_path: Path | None,
        max_inflight_per_pod: int,
        *,
        segment_cache_entries: int = 50_000,
        segment_cache_bytes: int = 256 * 2**20,
        log_queue_size: int = 20_000,
        block_chain: str = "auto",
        block_size: int = 0,
        chain_process: bool = True,
    ) -> None:
        self.base_urls = {name: _api_base(url) for name, url in pods}
        self.urls = {  # per pod and path, parsed once
            name: {path: pod_url(url, path) for path in ("/chat/completions", "/completions", "/models")}
            for name, url in self.base_urls.items()
        }
        self.router = make_router(
            policy, [name for name, _ in pods], max_inflight_per_pod=max_inflight_per_pod
        )
        self.counter = TokenCounter(tokenizer_path)
        self._empty_fingerprint = PromptFingerprint.empty(self.counter.method)  # frozen: one for every request
        self.cache = SegmentCache(segment_cache_entries, segment_cache_bytes)
        self.log = BackgroundLogWriter(log_path, max_queue=log_queue_size)
        self.turns = TurnGaps()
        chainer = RemoteChainer if chain_process and block_chain != "off" else BlockChainer
        self.chainer: BlockChainer | RemoteChainer = chainer(self.base_urls, block_chain, block_size)
        self._chaining: set[asyncio.Task[None]] = set()
        self.client: UpstreamClient | None = None

    async def start(self) -> None:
        self.client = UpstreamClient(UPSTREAM_TIMEOUT)
        if isinstance(self.chainer, RemoteChainer):
            await self.chainer.start()

    async def stop(self) -> None:
        if self._chaining:  # lines waiting for their chain: give them a moment, then log them without
            await asyncio.wait(set(self._chaining), timeout=15.0)
            for task in set(self._chaining):
                task.cancel()
            await asyncio.gather(*self._chaining, return_exceptions=True)
        if isinstance(self.chainer, RemoteChainer):
            await self.chainer.aclose()
        if self.client is not None:
            await self.client.aclose()
        self.log.close()

    def _fingerprint(self, body: dict[str, Any], endpoint: Endpoint) -> PromptFingerprint:
        return fingerprint_request(body, endpoint, self.counter, self.cache)

    # --- request handling -------------------------------------------------------------------------------

    async def completion(self, request: Request, endpoint: Endpoint) -> Response:
        arrival, arrival_wall = time.monotonic(), time.time()
        header_items = request.headers.items()  # decoded once; `first` as Headers.get answers: the first one
        first: dict[str, str] = {}
        for name, value in header_items:
            if name not in first:
                first[name] = value
        ex = _Exchange(
            request_id=fit_name(first.get("x-request-id") or ""),
            arrival_wall=arrival_wall,
            arrival=arrival,
            endpoint=endpoint,
            routing_policy=self.router.policy,
            fingerprint=self._empty_fingerprint,
        )
        try:
            raw_body = await request.body()
            body = json.loads(raw_body)
            if not isinstance(body, dict):
                raise ValueError("the request body is not a JSON object")
        except ValueError as exc:
            ex.request_id = ex.request_id or uuid.uuid4().hex
            return self._finish_now(ex, 400, f"invalid JSON body: {exc}")

        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        for name in ("tenant_id", "conversation_id", "agent_run_id"):
            value = first.get(_ID_HEADERS[name]) or metadata.get(name) or ""
            setattr(ex, name, fit_name(str(value)))
        if not ex.request_id and isinstance(body.get("request_id"), str) and body["request_id"]:
            ex.request_id = fit_name(body["request_id"])
        ex.request_id = ex.request_id or uuid.uuid4().hex
        ex.model = fit_name(str(body.get("model") or ""))
        ex.stream = bool(body.get("stream"))
        ex.skip_reading_prefix_cache = skips_prefix_cache(body, endpoint)
        ex.engine_requests = engine_requests(body, endpoint)
        ex.continue_final_message = endpoint == "chat.completions" and continues_final_message(body)
        try:  # cached or short segments on the loop; tokenizing a long new prompt takes ms: on a thread
            try:
                ex.fingerprint = fingerprint_request(
                    body, endpoint, self.counter, self.cache, budget=INLINE_FINGERPRINT_BUDGET
                )
            except SegmentBudgetExceeded:
                ex.fingerprint = await run_in_threadpool(self._fingerprint, body, endpoint)
        except FingerprintError:
            pass  # vLLM judges the body; the line keeps empty fingerprint fields (but its cache_salt_hash)
        except Exception:  # a body shape the library did not foresee must not drop the request
            log.exception("fingerprinting failed; forwarding without a fingerprint. request_id=%s", ex.request_id)
        if not ex.fingerprint.cache_salt_hash:  # a body the fingerprint could not read: its salt is still logged
            ex.fingerprint = salted(ex.fingerprint, cache_salt_hash(body))
        if self.chainer.enabled:
            ex.body = body
        ex.turn_key = TurnGaps.key(ex.agent_run_id, ex.conversation_id)
        ex.tool_latency_ms = self.turns.arrive(ex.turn_key, arrival)
        try:
            return await self._forward(ex, body, raw_body, header_items)
        except BaseException as exc:  # incl. cancellation at shutdown: still one line, pod released
            if not ex.logged:
                ex.status = ex.status if ex.status >= 400 else 500
                # the class only: an exception's text may carry request content
                ex.error = ex.error or gateway_error(ex.status, type(exc).__name__)
                self._finish(ex, exc)
            raise

    async def _forward(
        self, ex: _Exchange, body: dict[str, Any], raw_body: bytes, headers: list[tuple[str, str]]
    ) -> Response:
        """Send the request to a pod (retrying another pod on a refused connection) and build the
        response that relays the answer and writes the log line when done."""
        changed, client_wants_usage = _prepare_body(body, ex.stream)
        upstream_headers = [(k, v) for k, v in headers if k not in _DROP_REQUEST_HEADERS]
        upstream_headers += [("x-request-id", ex.request_id), ("accept-encoding", "identity")]
        payload = _encode_body(body).encode("utf-8") if changed else raw_body
        path = "/chat/completions" if ex.endpoint == "chat.completions" else "/completions"
        keys = (ex.fingerprint.prompt_fingerprint, ex.fingerprint.parent_fingerprint,
                ex.fingerprint.prefill_parent_fingerprint)

        tried: list[str] = []
        while True:
            try:
                route = self.router.choose(keys, exclude=tried)
            except NoPodAvailable:
                return self._finish_now(ex, 502, f"no pod reachable (tried {', '.join(tried)})")
            ex.pod, ex.routing_reason, ex.pods_down = route
            ex.holds_pod = True
            assert self.client is not None, "Gateway.start() was not awaited"
            try:
                upstream = await self.client.request("POST", self.urls[route.pod][path], upstream_headers, payload)
                break
            except UpstreamConnectError:  # nothing reached the pod: safe to retry
                self._release(ex)
                self.router.mark_down(route.pod)
                tried.append(route.pod)
            except UpstreamError as exc:
                self._release(ex)
                status = 504 if isinstance(exc, UpstreamTimeout) else 502
                return self._finish_now(ex, status, f"pod {route.pod}: {type(exc).__name__}: {exc}")

        ex.status = upstream.status_code
        out_headers = {"x-request-id": ex.request_id}
        for name in ("content-type", "cache-control"):
            if name in upstream.headers:
                out_headers[name] = upstream.headers[name]
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if ex.stream and upstream.status_code < 400 and is_sse:
            response: Any = _LoggedStreamingResponse(
                self._relay_stream(ex, upstream, client_wants_usage), ex.status, headers=out_headers
            )
        else:
            try:
                content = await upstream.aread()
            except UpstreamError as exc:
                upstream.close()
                self._release(ex)
                status = 504 if isinstance(exc, UpstreamTimeout) else 502
                return self._finish_now(ex, status, f"pod {route.pod}: {type(exc).__name__}: {exc}")
            except BaseException:
                upstream.close()
                raise
            finally:
                ex.first_token = time.monotonic()
            ex.done = True
            if ex.status >= 400:
                ex.error = pod_error(content, ex.status)
            else:
                try:
                    ex.read_usage(json.loads(content))
                except (ValueError, TypeError, AttributeError):
                    ex.error = "unreadable response body from the pod"
            response = _LoggedResponse(content, ex.status, headers=out_headers)
        response.on_done = lambda exc: self._finish(ex, exc)
        response.upstream = upstream
        return response

    async def _relay_stream(
        self, ex: _Exchange, upstream: UpstreamResponse, client_wants_usage: bool
    ) -> AsyncIterator[bytes]:
        """Pass SSE events through unchanged, reading usage/metrics/errors on the way; drop the final
        usage-only chunk when the gateway added `include_usage` for itself."""
        buffer = b""
        async for data in upstream.aiter_bytes():
            # reads of already buffered bytes do not suspend: let the loop run (a client's disconnect, other
            # requests) once per piece, as httpx/anyio did with a checkpoint per read
            await asyncio.sleep(0)
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if self._inspect_event(ex, event, client_wants_usage):
                    yield event + b"\n\n"
        if buffer:
            yield buffer
        ex.done = True

    def _inspect_event(self, ex: _Exchange, event: bytes, client_wants_usage: bool) -> bool:
        """Read one SSE event; return whether to forward it."""
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                continue
            if not isinstance(chunk, dict):
                continue
            if ex.first_token is None and _has_content(chunk):
                ex.first_token = time.monotonic()
            if "error" in chunk:
                ex.error = pod_error(data, ex.status)
            ex.read_usage(chunk)
            if not client_wants_usage and chunk.get("usage") and not chunk.get("choices"):
                return False
        return True

    def _release(self, ex: _Exchange) -> None:
        if ex.holds_pod:
            ex.holds_pod = False
            self.router.release(ex.pod)

    def _finish(self, ex: _Exchange, exc: BaseException | None) -> None:
        """Write the request's log line (once); release its pod and its turn."""
        if ex.logged:
            return
        ex.logged = True
        now = time.monotonic()
        if ex.stream and ex.status < 400 and not ex.done and not ex.error:
            ex.error = f"stream not completed: {type(exc).__name__ if exc else 'client disconnected'}"
        if ex.stream and ex.status < 400 and not ex.usage_seen:
            # The usage chunk never came (client gone, stream cut): vLLM still prefilled the prompt. Keep the
            # request served with the fingerprint's count (segment tokens, by token_count_method) and the
            # cached count unknown (docs/decisions.md, "A stream without usage").
            fp = ex.fingerprint
            ex.prompt_tokens = (fp.system_tokens + fp.tools_tokens + fp.retrieval_tokens + fp.history_tokens
                                + fp.suffix_tokens)
            ex.cached_tokens = None
            ex.error = ex.error or "stream ended without usage: prompt_tokens from the fingerprint"
        self._release(ex)
        self.turns.leave(ex.turn_key, now)
        record = ex.record(now)
        if ex.body is not None and self.chainer.wanted(ex.pod, ex.status) and self._chain_later(ex, record):
            return
        self.log.submit(record)

    def _chain_later(self, ex: _Exchange, record: dict[str, Any]) -> bool:
        """Start the task that adds the prompt's block chain to `record` and then logs it; False (log it now)
        when no event loop runs here or too many chains are in flight."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if len(self._chaining) >= MAX_PENDING:
            CHAIN_FAILURES.labels("busy").inc()
            return False
        task = loop.create_task(self._log_with_chain(ex, record))
        self._chaining.add(task)
        task.add_done_callback(self._chaining.discard)
        return True

    async def _log_with_chain(self, ex: _Exchange, record: dict[str, Any]) -> None:
        """Ask the pod for the prompt's token ids and block size, then log `record` with its chain (or
        without, whatever happens: the line is always submitted once)."""
        try:
            assert self.client is not None and ex.body is not None
            prompt = ex.prompt_tokens if ex.usage_seen else None
            hashes, size = await self.chainer.chain(self.client, ex.pod, ex.body, ex.endpoint, prompt)
            record["prompt_block_hashes"] = hashes
            record["prompt_block_size"] = size
        finally:
            ex.body = None
            self.log.submit(record)

    def _finish_now(self, ex: _Exchange, status: int, message: str) -> Response:
        """Log an error the gateway answers itself (no pod response) and build its response."""
        ex.status, ex.error = status, gateway_error(status, message)
        self._finish(ex, None)
        return JSONResponse(_error_body(message, status), status, headers={"x-request-id": ex.request_id})

    async def models(self, request: Request) -> Response:
        """GET /v1/models from the first pod that answers."""
        assert self.client is not None
        for urls in self.urls.values():
            try:
                upstream = await self.client.request("GET", urls["/models"], [("accept-encoding", "identity")])
                try:
                    content = await upstream.aread()
                finally:
                    upstream.close()
            except UpstreamError:
                continue
            return Response(content, upstream.status_code, media_type="application/json")
        return JSONResponse(_error_body("no pod reachable", 502), 502)

    async def health(self, request: Request) -> Response:
        inflight = self.router.inflight_snapshot()
        pods = [
            {"name": n, "base_url": u, "inflight": inflight[n], "up": self.router.is_up(n)}
            for n, u in self.base_urls.items()
        ]
        return JSONResponse(
            {
                "status": "ok",
                "routing_policy": self.router.policy,
                "pods": pods,
                "segment_cache": self.cache.stats(),
                "log": {"written": self.log.written, "dropped": self.log.dropped},
                "block_chain": {"mode": self.chainer.mode, "pending": len(self._chaining)},
            }
        )

    async def metrics(self, request: Request) -> Response:
        """Prometheus text of this process's default registry (e.g. dropped log records)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _api_base(url: str) -> str:
    """ "http://h:p", "http://h:p/" or "http://h:p/v1" → "http://h:p/v1"."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _prepare_body(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """Edit `body` in place for vLLM; return (whether it changed, whether the client itself asked for the
    usage chunk).

    Removes kvscope's `metadata` keys (and `metadata` when nothing else is left); for streams sets
    `stream_options.include_usage` so the final chunk carries usage (vLLM refuses `stream_options`
    without `stream: true`, `entrypoints/openai/chat_completion/protocol.py validate_stream_options`)."""
    changed = False
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        rest = {k: v for k, v in metadata.items() if k not in KVSCOPE_METADATA_KEYS}
        if len(rest) != len(metadata):
            changed = True
            if rest:
                body["metadata"] = rest
            else:
                del body["metadata"]
    if not stream:
        return changed, False
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    wants_usage = bool(options.get("include_usage"))
    if options.get("include_usage") is not True or "stream_options" not in body:
        changed = True
        body["stream_options"] = {**options, "include_usage": True}
    return changed, wants_usage


def make_app(
    pods: list[tuple[str, str]],
    log_path: Path,
    policy: str = "round_robin",
    tokenizer_path: Path | None = None,
    max_inflight_per_pod: int = 8,
    *,
    segment_cache_entries: int = 50_000,
    segment_cache_bytes: int = 256 * 2**20,
    log_queue_size: int = 20_000,
    block_chain: str = "auto",
    block_size: int = 0,
) -> Starlette:
    """The gateway as an ASGI app.

    `pods`: (name, base URL) pairs, e.g. ("pod-0", "http://127.0.0.1:8001") (a trailing /v1 is fine);
    `log_path`: the fingerprint log (JSONL, appended); `policy`: "round_robin" or "prefix_affinity";
    `tokenizer_path`: the served model's tokenizer.json (or its directory) for exact segment token counts,
    else they are estimated (chars / 4). `segment_cache_entries` / `segment_cache_bytes` bound the
    per-segment memo (`gateway.fingerprint.SegmentCache`); `log_queue_size` bounds the records waiting for
    the log writer thread (more are dropped and counted). `block_chain` ("auto" | "off") and `block_size`
    (tokens per KV block, 0 = each pod's /metrics) configure the prompt block chain logged after each answer
    (`gateway.block_chain`). Routes: POST /v1/chat/completions,
    POST /v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus). Raises ValueError for an
    unknown policy or block chain mode, an empty pod list or a pod URL that is not http(s).
    """
    gateway = Gateway(
        pods,
        Path(log_path),
        policy,
        tokenizer_path,
        max_inflight_per_pod,
        segment_cache_entries=segment_cache_entries,
        segment_cache_bytes=segment_cache_bytes,
        log_queue_size=log_queue_size,
        block_chain=block_chain,
        block_size=block_size,
    )

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def chat(request: Request) -> Response:
        return await gateway.completion(request, "chat.completions")

    async def completions(request: Request) -> Response:
        return await gateway.completion(request, "completions")

    app = Starlette(
        routes=[
            HttpRoute("/v1/chat/completions", chat, methods=["POST"]),
            HttpRoute("/v1/completions", completions, methods=["POST"]),
            HttpRoute("/v1/models", gateway.models, methods=["GET"]),
            HttpRoute("/health", gateway.health, methods=["GET"]),
            HttpRoute("/metrics", gateway.metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app



def serve(app: Starlette, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the gateway in the foreground until interrupted (uvicorn)."""
    uvicorn.run(app, host=host, port=port, log_level="info")


class GatewayServer:
    """Runs an app under uvicorn in a background thread, for tests and the demo.

    `start()` returns once the socket listens (raises RuntimeError if it does not within `timeout_seconds`);
    `url` is "http://host:port" (port 0 picks a free port); `stop()` shuts down and joins the thread.
    Usable as a context manager."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._thread: threading.Thread | None = None
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_seconds: float = 10.0) -> GatewayServer:
        self._thread = threading.Thread(target=self._server.run, name="kvscope-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_seconds
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway server did not start")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_seconds: float = 10.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_seconds)
        self._thread = None

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
