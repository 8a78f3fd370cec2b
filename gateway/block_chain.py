"""Precise mode, gateway side: each request's prompt block chain (gateway → vLLM pod's /tokenize and /metrics →
log line fields ``prompt_block_hashes`` / ``prompt_block_size``).

After the pod has answered (the client's response never waits for this), :class:`BlockChainer` asks the pod
that served the request for the token ids it prefilled: vLLM 0.32's ``POST /tokenize`` (at the server root, not
under /v1; ``vllm/entrypoints/serve/tokenize/protocol.py``) renders a chat request's messages with the same chat
template, tools and template kwargs as ``/v1/chat/completions`` (``TokenizeChatRequest``, answer
``{"count", "max_model_len", "tokens", "token_strs"}``), or tokenizes a completion prompt
(``TokenizeCompletionRequest``). A completion prompt given as token ids needs no call. The pod's block size
comes from its ``/metrics`` (``vllm:cache_config_info{block_size="..."}``), read per pod and cached for
:data:`BLOCK_SIZE_REFRESH_SECONDS`, read again after a failure, unless configured. The chain is
:func:`kvscope.block_hash.chain_hashes` over the full blocks (at most
:data:`kvscope.block_hash.MAX_PROMPT_BLOCKS`), salted as vLLM salts it when the body has a ``cache_salt`` (the
salt keys the first block), the same hash the collector computes from the pod's ``BlockStored`` events
(collector/kv_chains.py).

Chat request fields that shape the prompt and how they reach /tokenize (vLLM 0.32
``entrypoints/openai/chat_completion/protocol.py ChatCompletionRequest.build_chat_params``): ``messages``,
``tools``, ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``, ``chat_template``,
``mm_processor_kwargs``, ``media_io_kwargs`` as they are; ``documents`` and ``reasoning_effort`` (and the
``enable_thinking`` vLLM derives from it) merged into ``chat_template_kwargs`` as vLLM merges them. Requests
whose prompt /tokenize cannot reproduce get no chain (counted as ``unsupported_body``): ``truncate_prompt_tokens``,
``prompt_embeds``, several completion prompts in one request, and (vLLM's ``tool_choice`` / ``response_format``
template inputs, used by few templates) a token count that differs from the pod's ``usage.prompt_tokens``
(counted as ``count_mismatch``, never logged).

The gateway runs this in a helper process (``gateway/chain_worker.py``), so that its own core only passes a
message each way; in the process itself when the helper cannot run. Failures never fail or slow the client's
request: they are counted in
``kvscope_gateway_block_chain_failures_total{reason}`` and the line is logged with ``[]`` / ``0``. Mode ``auto``
turns a pod's chains off for :data:`RETRY_SECONDS` when its /tokenize is missing (404/405/501) or answers
without token ids (not vLLM); ``off`` never asks.
"""

from __future__ import annotations

import array
import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from prometheus_client import Counter

from gateway.fingerprint import prefilled_as_written
from gateway.upstream import UpstreamClient, UpstreamError, pod_url
from kvscope.block_hash import MAX_PROMPT_BLOCKS, block_digests, chain_root, external, none_hash, salt_keys

log = logging.getLogger("kvscope.gateway.block_chain")

MODES = ("auto", "off")
RETRY_SECONDS = 60.0
"""After a pod's /metrics gave no block size, or its /tokenize is missing, chains of that pod wait this long."""
TIMEOUT_SECONDS = 10.0
"""Bound on one /tokenize or /metrics call (the request is long answered: only the log line waits)."""
MAX_PENDING = 1024
"""Chains being computed at once; beyond it a line is logged without (counted as ``busy``)."""
SLICE_BLOCKS = 16
"""Blocks chained between two yields to the event loop (~5 µs a new block, ~1 µs a remembered one): a request
arriving meanwhile waits at most one slice, not a whole long prompt's hashing (a worker thread would hold the GIL
for up to its 5 ms switch interval instead)."""
BLOCK_SIZE_REFRESH_SECONDS = 15.0
"""A pod's block size is read again from its /metrics this long after the last read: a pod restarted with another
``--block-size`` has its chains hashed at the new size from then on (before, the size read first was kept for good,
and that pod's requests lost precise mode until the gateway restarted)."""
MODELS_REFRESH_SECONDS = 5.0
"""A pod's /v1/models is read again at most this often for a model name it did not list (LoRA adapters load at run
time)."""
MEMO_BLOCKS = 65_536
"""Block digests remembered by (parent digest, token ids) (:class:`DigestMemo`; ≤ ~450 bytes each, ≤ ~30 MB):
prompts mostly repeat blocks seen before (shared system prompts, conversation history), which then cost a dict
lookup instead of a pickle and a SHA-256."""

FAILURES = Counter(
    "kvscope_gateway_block_chain_failures_total",
    "Requests logged without their prompt block chain, by reason (tokenize_unavailable: the pod has no /tokenize; "
    "tokenize_failed / block_size_unknown: the pod's /tokenize or /metrics failed or answered nonsense; "
    "count_mismatch: /tokenize gave another token count than the pod's usage.prompt_tokens; unsupported_body: "
    "a prompt /tokenize cannot reproduce; model_unknown: a model the pod's /v1/models does not list yet, so "
    "whether a LoRA adapter served it is unknown; busy: too many chains in flight)",
    ["reason"],
)
CHAINS = Counter("kvscope_gateway_block_chains_total", "Requests logged with their prompt block chain")

_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)
_MISSING = frozenset({404, 405, 501})


class _TokenizeAnswer(msgspec.Struct):
    """The part of vLLM's TokenizeResponse read here (decoded by msgspec: ~10x json for 1,000 ids)."""

    tokens: list[Annotated[int, msgspec.Meta(ge=0)]]


_TOKENIZE_ANSWER = msgspec.json.Decoder(_TokenizeAnswer)


class _Model(msgspec.Struct):
    """One entry of an OpenAI-style ``GET /v1/models`` answer, as far as read here (vLLM's ``ModelCard``)."""

    id: str
    parent: str | None = None


class _ModelList(msgspec.Struct):
    data: list[_Model]


def count(hashes: list[str], size: int, reason: str) -> tuple[list[str], int]:
    """Count one request's outcome (``reason`` '' = a chain) in :data:`CHAINS` / :data:`FAILURES`; returns
    (hashes, size)."""
    if reason:
        FAILURES.labels(reason).inc()
    else:
        CHAINS.inc()
    return hashes, size


class ChainFailure(Exception):
    """No chain for this request; ``reason`` is the counter's label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def tokenize_request(body: Mapping[str, Any], endpoint: str) -> dict[str, Any] | list[int]:
    """The /tokenize body reproducing the prompt of a chat (``endpoint`` "chat.completions") or completion
    ("completions") request ``body``, or the token ids themselves when the completion prompt is token ids.
    Raises :class:`ChainFailure` ("unsupported_body") when /tokenize cannot reproduce it (see the module doc)."""
    if not prefilled_as_written(body):
        raise ChainFailure("unsupported_body")
    out: dict[str, Any] = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise ChainFailure("unsupported_body")
        out["prompt"] = prompt
        if body.get("add_special_tokens") is not None:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    if not isinstance(body.get("messages"), list):
        raise ChainFailure("unsupported_body")
    for key in ("messages", "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template", "mm_processor_kwargs", "media_io_kwargs"):
        if body.get(key) is not None:
            out[key] = body[key]
    user = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else {}
    kwargs = dict(user)
    for key in ("documents", "reasoning_effort"):  # vLLM's merge_kwargs: None and "auto" leave the user's value
        if body.get(key) not in (None, "auto"):
            kwargs[key] = body[key]
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in user:
        kwargs["enable_thinking"] = effort != "none"
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


def parse_block_size(metrics_text: str) -> int | None:
    """The ``block_size`` label of the first ``vllm:cache_config_info`` sample in a Prometheus text exposition,
    None when there is none (or it is 0)."""
    m = _BLOCK_SIZE.search(metrics_text)
    return int(m.group(1)) or None if m else None


@dataclass
class _Pod:
    root: str  # "http://host:port", where /tokenize and /metrics live
    block_size: int | None = None
    block_size_retry_at: float = 0.0  # time.monotonic(): no /metrics read before
    block_size_read_at: float = 0.0  # time.monotonic() of the read that gave block_size
    tokenize_retry_at: float = 0.0  # time.monotonic(): /tokenize missing, no chains before
    tokenize_ok: bool = False  # /tokenize answered with token ids (until it is found missing)
    probing: asyncio.Event | None = None  # set when the probe of a pod not yet known to answer ends
    lock: asyncio.Lock | None = None
    models: frozenset[str] = frozenset()  # every name its /v1/models lists
    adapters: frozenset[str] = frozenset()  # the LoRA adapters among them (a "parent" model)
    models_retry_at: float = 0.0  # time.monotonic(): no /v1/models read before


class BlockChainer:
    """Computes the prompt block chain of answered requests, per pod.

    ``pods``: name → API base URL ("http://h:p/v1" or "http://h:p"); ``mode``: one of :data:`MODES` (ValueError
    otherwise); ``block_size``: tokens per block for every pod, 0 = read each pod's /metrics. Use from the
    gateway's event loop only."""

    def __init__(self, pods: Mapping[str, str], mode: str = "auto", block_size: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"block chain mode {mode!r}: expected one of {', '.join(MODES)}")
        if block_size < 0:
            raise ValueError(f"block size {block_size} is negative")
        self.mode = mode
        self.block_size = block_size
        self.memo = DigestMemo()
        self.pods = {name: _Pod(url.rstrip("/").removesuffix("/v1")) for name, url in pods.items()}
        for p in self.pods.values():
            pod_url(p.root, "/tokenize")  # ValueError now rather than per request

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def wanted(self, pod: str, status: int) -> bool:
        """Whether a request answered by ``pod`` with ``status`` should get a chain (on, pod known, answer < 400,
        the pod's /tokenize not known missing: such a request is counted as ``tokenize_unavailable``)."""
        p = self.pods.get(pod)
        if not self.enabled or p is None or status >= 400:
            return False
        if time.monotonic() < p.tokenize_retry_at:
            FAILURES.labels("tokenize_unavailable").inc()
            return False
        return True

    async def chain(self, client: UpstreamClient, pod: str, body: Mapping[str, Any], endpoint: str,
                    prompt_tokens: int | None) -> tuple[list[str], int]:
        """(chain hashes in block order as 16 lowercase hex characters, block size) of the prompt of ``body`` as
        ``pod`` prefilled it. ``prompt_tokens``: the pod's usage.prompt_tokens when it reported it (a different
        /tokenize count means the ids are not what it prefilled). Never raises but cancellation: a failure is
        counted (:func:`count`) and gives ([], 0)."""
        hashes, size, reason = await self.compute(client, pod, body, endpoint, prompt_tokens)
        return count(hashes, size, reason)

    async def compute(self, client: UpstreamClient, pod: str, body: Mapping[str, Any], endpoint: str,
                      prompt_tokens: int | None) -> tuple[list[str], int, str]:
        """:meth:`chain` uncounted: (hashes, block size, '') or ([], 0, the failure's reason)."""
        p = self.pods.get(pod)
        if p is None or time.monotonic() < p.tokenize_retry_at:
            return [], 0, "tokenize_unavailable"
        try:
            ids = await self._token_ids(client, pod, body, endpoint)
            if prompt_tokens is not None and len(ids) != prompt_tokens:
                raise ChainFailure("count_mismatch")
            size = await self._block_size(client, pod)
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            lora = await self._lora_name(client, pod, body.get("model"))
            hashes = await _chain_hashes(ids[: MAX_PROMPT_BLOCKS * size], size, self.memo, salt, lora)
        except ChainFailure as exc:
            return [], 0, exc.reason
        except Exception:  # a bug here must cost only the chain
            log.exception("block chain failed. pod=%s", pod)
            return [], 0, "tokenize_failed"
        return hashes, size, ""

    async def _token_ids(self, client: UpstreamClient, pod: str, body: Mapping[str, Any], endpoint: str
                         ) -> list[int]:
        request = tokenize_request(body, endpoint)
        if isinstance(request, list):
            return request
        p = self.pods[pod]
        # until the pod is known to answer /tokenize, one request asks and the others wait for its verdict (a pod
        # without it must not get a burst of calls, one per request in flight)
        while not p.tokenize_ok and p.probing is not None:
            await p.probing.wait()
            if time.monotonic() < p.tokenize_retry_at:
                raise ChainFailure("tokenize_unavailable")
        probe = None
        if not p.tokenize_ok:
            probe = p.probing = asyncio.Event()
        try:
            ids = await self._tokenize(client, pod, msgspec.json.encode(request))
        finally:
            if probe is not None:
                p.probing = None
                probe.set()
        p.tokenize_ok = True
        return ids

    async def _tokenize(self, client: UpstreamClient, pod: str, payload: bytes) -> list[int]:
        """The token ids of one /tokenize call. Raises ChainFailure."""
        p = self.pods[pod]
        status, content = await _call(client, "POST", p.root + "/tokenize", payload)
        if status in _MISSING and b'"error"' not in content:  # vLLM's own errors (unknown model) carry "error"
            self._tokenize_missing(pod, f"HTTP {status}")
        if status != 200:
            raise ChainFailure("tokenize_failed")
        try:
            ids = _TOKENIZE_ANSWER.decode(content).tokens
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._tokenize_missing(pod, "an answer without token ids")  # not vLLM's /tokenize
        return ids

    def _tokenize_missing(self, pod: str, what: str) -> None:
        """The pod has no usable /tokenize: no chains for it during RETRY_SECONDS. Raises ChainFailure."""
        p = self.pods[pod]
        p.tokenize_ok = False
        if time.monotonic() >= p.tokenize_retry_at:
            log.warning("pod %s /tokenize gave %s: no block chains for %.0f s", pod, what, RETRY_SECONDS)
        p.tokenize_retry_at = time.monotonic() + RETRY_SECONDS
        raise ChainFailure("tokenize_unavailable")

    async def _block_size(self, client: UpstreamClient, pod: str) -> int:
        if self.block_size:
            return self.block_size
        p = self.pods[pod]
        if p.block_size and time.monotonic() - p.block_size_read_at < BLOCK_SIZE_REFRESH_SECONDS:
            return p.block_size
        if p.lock is None:
            p.lock = asyncio.Lock()
        async with p.lock:  # one /metrics read per pod at a time
            stale = p.block_size and time.monotonic() - p.block_size_read_at >= BLOCK_SIZE_REFRESH_SECONDS
            if stale or (p.block_size is None and time.monotonic() >= p.block_size_retry_at):
                try:
                    status, content = await _call(client, "GET", p.root + "/metrics")
                    size = parse_block_size(content.decode("utf-8", "replace")) if status == 200 else None
                except ChainFailure:
                    size = None
                if size or not stale:  # a refresh that failed keeps the size it had until the next one
                    p.block_size = size
                p.block_size_read_at = time.monotonic()
                if p.block_size is None:
                    p.block_size_retry_at = time.monotonic() + RETRY_SECONDS
                    log.warning("pod %s: no vllm:cache_config_info block_size in /metrics; retry in %.0f s", pod,
                                RETRY_SECONDS)
        if not p.block_size:
            raise ChainFailure("block_size_unknown")
        return p.block_size


    async def _lora_name(self, client: UpstreamClient, pod: str, model: Any) -> str | None:
        """``model`` when ``pod`` serves it as a LoRA adapter, None for its base model. The pod's
        ``GET /v1/models`` (vLLM: every served name, an adapter with its base model as ``parent``,
        ``vllm/entrypoints/openai/models/serving.py``) is read when a request names a model it did not list
        (adapters load at run time), at most once per :data:`MODELS_REFRESH_SECONDS`, after a failure once per
        :data:`RETRY_SECONDS`. A pod that never listed its models (not vLLM) serves no adapters. Raises
        ChainFailure("model_unknown") for a name the pod's list still lacks: which chain it has is not known."""
        if not isinstance(model, str) or not model:
            return None
        p = self.pods[pod]
        if model not in p.models and time.monotonic() >= p.models_retry_at:
            if p.lock is None:
                p.lock = asyncio.Lock()
            async with p.lock:
                if model not in p.models and time.monotonic() >= p.models_retry_at:
                    await self._read_models(client, pod)
        if p.models and model not in p.models:
            raise ChainFailure("model_unknown")
        return model if model in p.adapters else None

    async def _read_models(self, client: UpstreamClient, pod: str) -> None:
        p = self.pods[pod]
        p.models_retry_at = time.monotonic() + MODELS_REFRESH_SECONDS
        try:
            status, content = await _call(client, "GET", p.root + "/v1/models")
            listed = msgspec.json.decode(content, type=_ModelList).data if status == 200 else None
        except (ChainFailure, msgspec.DecodeError, msgspec.ValidationError):
            listed = None
        if listed is None:  # keep the last list read, if any
            p.models_retry_at = time.monotonic() + RETRY_SECONDS
            return
        p.models = frozenset(m.id for m in listed)
        p.adapters = frozenset(m.id for m in listed if m.parent)


class DigestMemo:
    """Block digests (:func:`kvscope.block_hash.block_digests`) and their chain hash as logged (16 hex characters)
    by (parent digest, the block's token ids), at most ``max_entries``, the oldest eighth dropped when full. Not
    thread safe (the gateway's event loop owns it)."""

    def __init__(self, max_entries: int = MEMO_BLOCKS) -> None:
        self.max_entries = max_entries
        self.root = none_hash()
        self._digests: dict[bytes, tuple[bytes, str]] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def digests(self, block_tokens: list[int], block_size: int, parent: bytes) -> list[tuple[bytes, str]]:
        """(digest, chain hash as 16 lowercase hex characters) of each full block of ``block_tokens`` (ints ≥ 0),
        chained from ``parent`` (:attr:`root` at the prompt's start); the digests equal
        ``block_digests(block_tokens, block_size, parent)``, the hex ``f"{external(digest):016x}"``."""
        out: list[tuple[bytes, str]] = []
        memo = self._digests
        for i in range(len(block_tokens) // block_size):
            block = block_tokens[i * block_size:(i + 1) * block_size]
            key = parent + array.array("Q", block).tobytes()
            entry = memo.get(key)
            if entry is None:
                digest = block_digests(block, block_size, parent)[0]
                entry = (digest, f"{external(digest):016x}")
                if len(memo) >= self.max_entries:
                    for old in list(memo)[: max(1, self.max_entries // 8)]:
                        del memo[old]
                memo[key] = entry
            out.append(entry)
            parent = entry[0]
        return out


async def _chain_hashes(token_ids: list[int], block_size: int, memo: DigestMemo | None = None,
                        cache_salt: str | None = None, lora_name: str | None = None) -> list[str]:
    """:func:`kvscope.block_hash.chain_hashes` of ``token_ids`` (ints ≥ 0) with ``cache_salt`` (None or "" = no
    salt) and ``lora_name`` (the LoRA adapter that served it, None = the base model) as 16-hex-character strings,
    computed :data:`SLICE_BLOCKS` blocks at a time with a yield to the event loop after each slice, through
    ``memo`` (a fresh one when None; a salted first block is hashed outside it, the blocks after it are remembered
    under their salted parent; an adapter's blocks under its root, :func:`kvscope.block_hash.chain_root`)."""
    memo = memo if memo is not None else DigestMemo()
    out: list[str] = []
    parent = chain_root(lora_name) if lora_name else memo.root
    first = 0
    if cache_salt and len(token_ids) >= block_size:
        parent = block_digests(token_ids[:block_size], block_size, parent, extra_keys=[salt_keys(cache_salt)])[0]
        out.append(f"{external(parent):016x}")
        first = block_size
    step = SLICE_BLOCKS * block_size
    for start in range(first, len(token_ids) // block_size * block_size, step):
        entries = memo.digests(token_ids[start:start + step], block_size, parent)
        out += [h for _, h in entries]
        parent = entries[-1][0]
        await asyncio.sleep(0)
    return out


async def _call(client: UpstreamClient, method: str, url: str, body: bytes = b"") -> tuple[int, bytes]:
    """(status, body) of one request, within :data:`TIMEOUT_SECONDS`. Raises ChainFailure("tokenize_failed") when
    the pod cannot be reached or does not answer in time."""
    headers = [("accept-encoding", "identity")]
    if body:
        headers.append(("content-type", "application/json"))
    try:
        async with asyncio.timeout(TIMEOUT_SECONDS):
            response = await client.request(method, url, headers, body)
            try:
                return response.status_code, await response.aread()
            finally:
                response.close()
    except (UpstreamError, TimeoutError) as exc:
        raise ChainFailure("block_size_unknown" if method == "GET" else "tokenize_failed") from exc
