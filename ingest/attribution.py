"""Miss-cause attribution, the pure logic (gateway_requests → here → miss_attribution): for every request,
name the cause of each prompt token vLLM's prefix cache did not serve (docs/miss-causes.md).

No I/O here: :mod:`ingest.attribution_job` reads requests and block sizes from the store, calls
:func:`attribute`, and writes the rows. Everything is deterministic: the same requests give the same rows in
the same order, so a rerun after a crash rewrites identical rows.

The model, in three steps (one function each):

1. **Predecessor** (:class:`PredecessorIndex`): the most recent earlier request (``ts`` strictly before,
   within the horizon) that this request could have reused KV blocks from, by priority: the previous turn
   of the same conversation, else of the same agent run, else the previous turn its messages name (clients that
   send no id: :data:`MESSAGE_LOOKUPS`); else the latest request of the same model with
   the same ``prompt_fingerprint`` (any tenant); else the latest request of the same tenant and model whose
   prefix is the same modulo a nameable change (same normalized system prompt, canonical tools or
   retrieval set, or half of the system prompt's lines with the rest nearly equal: :func:`lines_match`).
2. **Shared prefix and drift** (:func:`shared_prefix`): walk the segments [system][tools][retrieval]
   [history][suffix] in prompt order; the shared length S ends at the first segment whose raw hash differs,
   and that segment's variant hashes name the drift.
3. **Token split** (:func:`split_missed_tokens`): lay labelled zones over token positions [0, prompt_tokens)
   and count, per zone, the missed tokens [cached_tokens, prompt_tokens) that fall in it.

A request with no predecessor within the horizon looks further back, up to the lookback, by the same rules: a
predecessor found there is *beyond the horizon*, and what it shared is :data:`BEYOND_HORIZON`, not ``cold``
(the prefix was seen, too long ago for the cache to be expected to hold it).

vLLM facts used (vLLM 0.32, ``v1/core/kv_cache_manager.py``, docs/environment.md): only full
blocks of ``block_size`` tokens are cached and hit, per pod; the last prompt token is always recomputed, so
the most a request can hit is ``floor((prompt_tokens - 1) / B) * B`` (a real 762-token prompt repeated on the
same pod hit 736 with B = 32).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from datetime import UTC, datetime
from typing import Any

# -- names (docs/miss-causes.md; use exactly these everywhere) ------------------------------
UNAVOIDABLE = "unavoidable"
BELOW_BLOCK = "below_block"
COLD = "cold"
#: The prefix was seen, but its predecessor lies beyond the horizon (within the lookback): kept apart from cold.
BEYOND_HORIZON = "beyond_horizon"
ROUTED_AWAY = "routed_away"
EVICTED = "evicted"
PREFIX_DRIFT = "prefix_drift"
UNKNOWN = "unknown"
#: The pod did not report the request's cached count: all its prompt tokens, hit or missed, carry this cause.
NOT_REPORTED = "not_reported"
CAUSES = (UNAVOIDABLE, BELOW_BLOCK, COLD, BEYOND_HORIZON, ROUTED_AWAY, EVICTED, PREFIX_DRIFT, UNKNOWN, NOT_REPORTED)

VOLATILE_SYSTEM = "volatile_system"
SYSTEM_CHANGED = "system_changed"
TOOLS_REORDERED = "tools_reordered"
TOOLS_CHANGED = "tools_changed"
RAG_REORDERED = "rag_reordered"
RAG_CHANGED = "rag_changed"
HISTORY_TRUNCATED = "history_truncated"
#: The previous turn's history is this one's, but the message it sent last is not as it was sent: the client edited
#: or redacted it (gateway_requests.prev_suffix_hash differs from the previous turn's suffix_hash).
HISTORY_CHANGED = "history_changed"
#: The previous turn of the conversation / agent run was sent with another vLLM ``cache_salt``
#: (gateway_requests.cache_salt_hash differs): vLLM keys the salt into the first block, so the cache key changed at
#: token 0 and everything after it misses (docs/miss-causes.md).
CACHE_SALT_CHANGED = "cache_salt_changed"
DRIFT_SUB_CAUSES = (VOLATILE_SYSTEM, SYSTEM_CHANGED, TOOLS_REORDERED, TOOLS_CHANGED, RAG_REORDERED,
                    RAG_CHANGED, HISTORY_TRUNCATED, HISTORY_CHANGED, CACHE_SALT_CHANGED)
#: sub_cause of ``evicted`` when the predecessor is the previous turn of the same conversation or agent run.
EVICTED_BEFORE_NEXT_TURN = "evicted_before_next_turn"
#: sub_cause of ``evicted`` in precise mode when the blocks left this pod by a cache reset (vLLM's
#: ``AllBlocksCleared`` or a vLLM restart), not by a ``BlockRemoved``: a reset is not memory pressure.
CACHE_RESET = "cache_reset"
#: sub_cause of ``unknown`` in precise mode: the KV events show the block resident on this very pod at arrival,
#: yet it was missed (a race between the events and the scheduler, e.g. evicted while the request queued).
RESIDENT_AT_ARRIVAL = "resident_at_arrival"
#: sub_cause of ``not_reported``: vLLM read no prefix cache for the request (it asked for prompt logprobs:
#: ``SamplingParams.skip_reading_prefix_cache``), so there is no hit count; the gateway logs the flag.
SKIP_READING_PREFIX_CACHE = "skip_reading_prefix_cache"
#: sub_cause of ``not_reported``: vLLM ran the request as several engine requests (``n`` > 1, or a list of prompts;
#: gateway_requests.engine_requests), so its reported cached count is one sequence's, not the prompt's hit count.
SEVERAL_ENGINE_REQUESTS = "several_engine_requests"
#: sub_cause of ``routed_away``: the pod that held the prefix (the predecessor's pod, or in precise mode the block's
#: holder) was down when the request was routed (gateway_requests.pods_down): the outage, not the router, lost it.
POD_DOWN = "pod_down"
#: Every sub_cause attribution gives ("" aside): the drifts' and the other causes'.
SUB_CAUSES = (*DRIFT_SUB_CAUSES, EVICTED_BEFORE_NEXT_TURN, CACHE_RESET, RESIDENT_AT_ARRIVAL, SKIP_READING_PREFIX_CACHE,
              SEVERAL_ENGINE_REQUESTS, POD_DOWN)

#: request_attribution.evidence: what a verdict's routed_away / evicted part rests on (docs/miss-causes.md).
EVIDENCE_KV_EVENTS = "kv_events"  # precise mode: the request's block chain matched against the pods' KV events
EVIDENCE_INFERRED = "inferred"  # routed_away / evicted concluded from the predecessor's pod
EVIDENCE_FINGERPRINTS = "fingerprints"  # segment hashes alone: no routed_away / evicted part
EVIDENCES = (EVIDENCE_KV_EVENTS, EVIDENCE_INFERRED, EVIDENCE_FINGERPRINTS)

#: Block states at a request's arrival (:class:`BlockStatus`), from the KV events of the pods of its model.
RESIDENT_HERE = "resident_here"  # resident on the request's own pod until it ended (and still missed: a race)
REMOVED_HERE = "removed_here"  # on the request's pod; its last copy left by a BlockRemoved (before it ended)
RESET_HERE = "reset_here"  # was on the request's pod; left by an AllBlocksCleared or a vLLM restart
RESIDENT_ELSEWHERE = "resident_elsewhere"  # resident on another pod serving the same model
NOWHERE = "nowhere"  # stored on no pod before arrival (as far as the events go): no evidence of reuse
BLOCK_STATES = (RESIDENT_HERE, REMOVED_HERE, RESET_HERE, RESIDENT_ELSEWHERE, NOWHERE)

#: Predecessor kinds, in priority order (step 1 of the module docstring).
PREVIOUS_TURN = "previous_turn"
FINGERPRINT = "fingerprint"
VARIANT = "variant"
#: Appended to the kind of a predecessor found beyond the horizon (request_attribution.predecessor_kind, e.g.
#: ``previous_turn_beyond_horizon``), so queries that read the plain kinds (affinity, turn gaps) keep counting
#: only predecessors within the horizon.
BEYOND_HORIZON_KIND_SUFFIX = "_beyond_horizon"

#: The keys on which a request finds its predecessor, as numbered in gateway_requests.predecessor_keys
#: (sql/migrations/0008): conversation, agent run, prompt fingerprint, then the three variant hashes.
KEY_CONVERSATION, KEY_AGENT_RUN, KEY_FINGERPRINT, KEY_SYSTEM_NORM, KEY_TOOLS_CANONICAL, KEY_RETRIEVAL_SET = range(1, 7)
#: Banded keys of the system prompt's lines (sql/migrations/0020): (line count, first half of the line hashes)
#: and (line count, second half). One changed line, wherever it sits, leaves one band equal.
KEY_SYSTEM_LINES_HEAD, KEY_SYSTEM_LINES_TAIL = 7, 8
#: Predecessor key 9: one thread of an agent run (tenant, model, agent_run_id, first_message_hash), so a turn of
#: one of the run's parallel sub-agents finds its own previous turn, not the latest of another thread.
KEY_AGENT_THREAD = 9
#: Predecessor key 10: one thread of a conversation (tenant, model, conversation_id, first_message_hash), so a turn
#: finds its own previous turn, not a side request the client tagged with the chat's id (a title, tags or memory
#: request: its own first message) nor another thread sharing the id (sub-agents of a session without a run id).
KEY_CONVERSATION_THREAD = 10
#: Predecessor keys 11 to 16: a conversation's previous turn by its messages, for clients that send no
#: conversation or run id (a plain OpenAI client). Each pair is an asymmetric key: the first is a request's own
#: messages, found by later requests; the second names the messages of the request it continues, and is looked
#: up. Both of a pair are hashed alike (:func:`match_key`, sql/migrations/0045), under (tenant, model,
#: cache_salt_hash, system_norm_hash):
#: - 11, its messages as sent: (history_prefix_hash, suffix_hash); 12, its previous request's as this history
#:   carries them with the reply after them: (prev_history_hash, prev_suffix_hash) (gateway/fingerprint.py);
#: - 13, its messages as one history (next_history_hash); 14, its history (history_prefix_hash): the previous
#:   request's messages re-sent with no reply between (a message sent before the reply came, user-only turns);
#: - 15, the history of a request that asked vLLM to continue its final assistant message (an assistant prefill,
#:   ``continue_final_message``); 16, the history before this request's last run of assistant messages
#:   (prefill_history_hash): the turn after a prefill, whose history carries the prefill completed.
#: Only a request with neither conversation_id nor agent_run_id has these keys (a client that sends ids finds its
#: turns on them; every key costs the predecessor search a row per request).
#: A lookup finds the latest request that sent those messages (11, 13, 15), never one that names the same previous
#: messages (12, 14, 16: another user whose chat starts with the same message, a one-shot app's fixed few-shot or
#: welcome messages): those are no turns of one conversation.
KEY_MESSAGES, KEY_PREVIOUS_MESSAGES, KEY_MESSAGES_AS_HISTORY, KEY_HISTORY = 11, 12, 13, 14
KEY_PREFILLED, KEY_PREFILL_HISTORY = 15, 16
#: Predecessor keys 17 and 18: one thread of a conversation (17: tenant, model, conversation_id,
#: first_message_hash, system_norm_hash) or of an agent run (18: …, agent_run_id, …) under one system prompt
#: (sql/migrations/0046). Never a predecessor by itself: when the turn the id keys found was sent under another
#: system prompt, the latest earlier request of the thread under this request's own takes its place
#: (:func:`same_system_turn`). A client that sends other calls with the chat's messages and id under a system prompt
#: of their own (a guardrail or judge, the router and responder nodes of an agent graph) has two threads of the same
#: messages; each takes its own.
KEY_CONVERSATION_SYSTEM, KEY_AGENT_RUN_SYSTEM = 17, 18
SAME_SYSTEM_KEYS = (KEY_AGENT_RUN_SYSTEM, KEY_CONVERSATION_SYSTEM)
#: Predecessor key 19: the first content-defined chunk of the final message (tenant, model, cache_salt_hash, its
#: hash), for a request with nothing before that message (no system prompt, tools, documents or history: a plain
#: script, an eval harness, a batch classifier that sends its instructions in the one user message) whose first
#: chunk holds at least :data:`MIN_HEAD_TOKENS` tokens (sql/migrations/0047). A variant: such a prompt has no
#: other key (its fingerprint covers the stable prefix, which is empty), and another request with the same
#: instructions, or the same prompt, held them in some pod's cache.
KEY_MESSAGE_HEAD = 19
#: Predecessor key 20: the instruction head of the system prompt (tenant, model, cache_salt_hash, the hashes of its
#: lines before the first blank line), for a system prompt with a blank line after a head of at least
#: :data:`MIN_HEAD_TOKENS` tokens and more lines after it (sql/migrations/0049). A client that puts retrieved documents
#: into the system prompt after a fixed instruction (LangChain's ``create_retrieval_chain``: "Use the following pieces
#: of retrieved context ...\n\n{context}") changes every other key with its documents; the same instructions held
#: by another request are found here. Tried only when no other variant key found a request
#: (:func:`choose_predecessor`): the same normalized system prompt, tools or lines are closer relatives.
KEY_SYSTEM_HEAD = 20
#: The first chunk must hold this many tokens to be a key (a block at vLLM's default size): a shorter shared head
#: ("Hi,") is no reusable prefix.
MIN_HEAD_TOKENS = 16
#: The thread key each same-system key narrows: a same-system candidate taken when the id keys' were all another
#: thread's is a previous turn of the thread.
THREAD_OF_SAME_SYSTEM = {KEY_AGENT_RUN_SYSTEM: KEY_AGENT_THREAD, KEY_CONVERSATION_SYSTEM: KEY_CONVERSATION_THREAD}
#: The turn keys of a conversation or run id (:data:`TURN_KEYS`' first four), in that order.
ID_TURN_KEYS = (KEY_AGENT_THREAD, KEY_CONVERSATION_THREAD, KEY_CONVERSATION, KEY_AGENT_RUN)
#: The looked-up kind of each pair → the kind it must find (a request's own messages).
MESSAGE_LOOKUPS = {KEY_PREVIOUS_MESSAGES: KEY_MESSAGES, KEY_HISTORY: KEY_MESSAGES_AS_HISTORY,
                   KEY_PREFILL_HISTORY: KEY_PREFILLED}
MESSAGE_FOUND_KINDS = tuple(MESSAGE_LOOKUPS.values())
#: The keys whose latest request is the previous turn, in the order :func:`choose_predecessor` prefers them: the
#: threads first, the most specific (sub-agents often carry the session's conversation_id too; a conversation may
#: span several agent runs, whose first turn then finds the conversation's latest request); a turn whose first
#: message is new (the client dropped or summarized the oldest messages) finds the conversation's latest.
TURN_KEYS = (*ID_TURN_KEYS, KEY_HISTORY, KEY_PREFILL_HISTORY, KEY_PREVIOUS_MESSAGES)
#: The message lookups in that order.
MESSAGE_TURN_KEYS = tuple(k for k in TURN_KEYS if k in MESSAGE_LOOKUPS)
BAND_KEYS = (KEY_SYSTEM_LINES_HEAD, KEY_SYSTEM_LINES_TAIL)
VARIANT_KEYS = (KEY_SYSTEM_NORM, KEY_TOOLS_CANONICAL, KEY_RETRIEVAL_SET, *BAND_KEYS, KEY_MESSAGE_HEAD)

#: Structural fields (gateway/fingerprint.py): hashes and tokens of each line of the system prompt, and of each
#: content-defined chunk of the suffix (the final message), in order.
LINE_HASHES, LINE_TOKENS = "system_line_hashes", "system_line_tokens"
CHUNK_HASHES, CHUNK_TOKENS = "suffix_chunk_hashes", "suffix_chunk_tokens"
#: A system prompt needs this many lines for the structural rule (fewer: one changed line is most of it).
MIN_STRUCTURE_LINES = 3
#: The structural rule: at most this share of the lines (rounded down, at least one line) may differ.
VOLATILE_LINE_SHARE = 0.25

#: vLLM's DEFAULT_BLOCK_SIZE (``vllm/config/cache.py``): tokens per block for a pod whose
#: ``vllm:cache_config_info`` is unknown.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_HORIZON_SECONDS = 3600.0
#: How far back a request without a predecessor within the horizon looks for one beyond it (7 days).
DEFAULT_LOOKBACK_SECONDS = 7 * 86400.0

#: The gateway_requests columns this module reads (the job selects exactly these).
REQUEST_FIELDS = (
    "request_id", "ts", "tenant_id", "conversation_id", "agent_run_id", "model", "pod", "status",
    "prompt_tokens", "cached_tokens", "e2e_ms",
    "system_hash", "system_norm_hash", "system_tokens",
    "tools_hash", "tools_canonical_hash", "tools_tokens",
    "retrieval_pack_hash", "retrieval_set_hash", "retrieval_tokens",
    "history_prefix_hash", "prev_history_hash", "prev_suffix_hash", "next_history_hash",
    "first_message_hash", "prefill_history_hash", "continue_final_message", "history_tokens",
    "suffix_hash", "suffix_tokens", "prompt_fingerprint",
    LINE_HASHES, LINE_TOKENS, CHUNK_HASHES, CHUNK_TOKENS, "cache_salt_hash", "skip_reading_prefix_cache",
    "engine_requests", "pods_down",
)

Request = Mapping[str, Any]
"""One gateway_requests row as a mapping (keys: :data:`REQUEST_FIELDS`; ``ts`` a datetime, naive = UTC)."""


@dataclass(frozen=True)
class Segment:
    """A stable-prefix segment: its raw hash, token count and variant hash columns, and the drift sub-causes
    for "variant equal, raw differs" (``reordered``) and "variant differs too" (``changed``)."""

    name: str
    hash_field: str
    tokens_field: str
    variant_field: str
    reordered: str
    changed: str


#: The stable prefix in prompt order (the suffix follows; docs/miss-causes.md). History has no variant
#: hash: continuity is checked with ``prev_history_hash`` instead (see :func:`shared_prefix`).
STABLE_SEGMENTS = (
    Segment("system", "system_hash", "system_tokens", "system_norm_hash", VOLATILE_SYSTEM, SYSTEM_CHANGED),
    Segment("tools", "tools_hash", "tools_tokens", "tools_canonical_hash", TOOLS_REORDERED, TOOLS_CHANGED),
    Segment("retrieval", "retrieval_pack_hash", "retrieval_tokens", "retrieval_set_hash", RAG_REORDERED,
            RAG_CHANGED),
    Segment("history", "history_prefix_hash", "history_tokens", "", "", HISTORY_TRUNCATED),
)
HISTORY = 3  # index of the history segment in STABLE_SEGMENTS
#: The variant hashes that find a ``variant`` predecessor (rule 3).
VARIANT_FIELDS = ("system_norm_hash", "tools_canonical_hash", "retrieval_set_hash")


@dataclass(frozen=True)
class Predecessor:
    """The earlier request this one could have reused KV blocks from; ``kind`` is one of
    :data:`PREVIOUS_TURN`, :data:`FINGERPRINT`, :data:`VARIANT`; ``beyond_horizon``: found only in the longer
    lookback (older than the horizon), so its reusable part is :data:`BEYOND_HORIZON`."""

    request: Request
    kind: str
    beyond_horizon: bool = False

    @property
    def stored_kind(self) -> str:
        """The kind as request_attribution stores it: ``kind``, with :data:`BEYOND_HORIZON_KIND_SUFFIX` when
        the predecessor lies beyond the horizon."""
        return self.kind + (BEYOND_HORIZON_KIND_SUFFIX if self.beyond_horizon else "")


@dataclass(frozen=True)
class SharedPrefix:
    """What a request shares with its predecessor, in tokens from the prompt start of *this* request.

    ``shared_tokens`` (S): identical prefix (never more than the predecessor's prompt). ``drift_sub_cause``:
    one of :data:`DRIFT_SUB_CAUSES`, or "" when the prefix ends only where new content starts (the suffix, or
    the new turn's messages). ``drift_at_tokens`` (D): where the changed segment starts (None without drift).
    ``reusable_without_drift_tokens`` (W): how far the prefix would have been shared had the named change
    (and any later nameable one) not happened; equals S without drift. ``identical``: every segment and the
    suffix are raw-equal, so the prompt repeats the predecessor's token for token and S is exact (the
    predecessor's prompt_tokens as vLLM counted them), not a boundary estimated by scaling.
    """

    shared_tokens: int
    drift_sub_cause: str = ""
    drift_at_tokens: int | None = None
    reusable_without_drift_tokens: int = 0
    identical: bool = False


@dataclass(frozen=True)
class MissRow:
    """One miss_attribution row (sql/migrations/0005): ``tokens`` missed tokens of ``request_id`` explained
    by ``cause``/``sub_cause``; the predecessor's id and pod ("" if none); ``gap_ms`` = predecessor end
    (its ts + e2e_ms) → this request's ts, ms (negative when they overlapped; None without predecessor);
    ``block_size`` (tokens) used for this request's pod."""

    request_id: str
    ts: datetime
    tenant_id: str
    pod: str
    model: str
    cause: str
    sub_cause: str
    tokens: int
    predecessor_request_id: str
    predecessor_pod: str
    gap_ms: float | None
    block_size: int

    def as_tuple(self) -> tuple[Any, ...]:
        """Values in :data:`MISS_ROW_COLUMNS` order."""
        return astuple(self)


MISS_ROW_COLUMNS = tuple(f.name for f in fields(MissRow))


@dataclass(frozen=True)
class BlockStatus:
    """Where one missed block of a request's chain was at the request's arrival, by the KV events
    (sql/migrations/0017 kv_block_log, kv_cache_resets): ``state`` one of :data:`BLOCK_STATES`; ``pod``: the pod
    that held it (the holder for :data:`RESIDENT_ELSEWHERE`, the request's pod for the ``*_HERE`` states, ""
    for :data:`NOWHERE`); ``removed_at``: when it left the request's pod (aware UTC; ``*_HERE`` departures)."""

    state: str
    pod: str = ""
    removed_at: datetime | None = None


@dataclass(frozen=True)
class KvEvidence:
    """Precise mode's input for one request (built by :mod:`ingest.kv_evidence`).

    ``block_size``: tokens per block of the request's chain (gateway_requests.prompt_block_size); it must equal
    the block size the attribution uses for the pod, else the evidence is ignored. ``blocks``: the status of the
    request's missed blocks in chain order, from block k0 = cached_tokens // block_size on (may stop after the
    first :data:`NOWHERE`; never beyond the last hittable block). ``covered_pods``: the pods whose KV events
    cover the arrival: a predecessor on one of them whose blocks were resident nowhere could not have served
    them (see :func:`judge`).
    """

    block_size: int
    blocks: tuple[BlockStatus, ...]
    covered_pods: frozenset[str] = frozenset()


# -- small helpers ------------------------------------------------------------------------------------------
def _ts_ms(req: Request) -> int:
    """``ts`` as unix milliseconds (a naive datetime is taken as UTC)."""
    ts = req["ts"]
    if isinstance(ts, datetime):
        if ts.tzinfo is None:
            ts = ts.replace(tzinfo=UTC)
        return round(ts.timestamp() * 1000)
    return int(ts)


def _int(req: Request, key: str) -> int:
    return max(0, int(req.get(key) or 0))


def _str(req: Request, key: str) -> str:
    return str(req.get(key) or "")


def _list(req: Request, key: str) -> list[Any]:
    """An array field as a list ([] when absent or null)."""
    value = req.get(key)
    return [] if value is None else list(value)


def _full_blocks(tokens: int, block_size: int) -> int:
    """``tokens`` rounded down to whole blocks (tokens)."""
    return max(0, tokens) // block_size * block_size


def order_key(req: Request) -> int:
    """A request's arrival order, unique per request: ts in unix ms × 2^20 + 20 bits of MD5(request_id)
    (orders requests of the same millisecond). The same formula as gateway_requests.order_key
    (sql/migrations/0008); a request's predecessor has a smaller order key and an earlier millisecond."""
    if "order_key" in req and req["order_key"] is not None:
        return int(req["order_key"])
    tie = int.from_bytes(hashlib.md5(_str(req, "request_id").encode()).digest()[:4], "little") >> 12
    return _ts_ms(req) * 1048576 + tie


def cached_unknown(req: Request) -> bool:
    """True when the pod did not report the request's cached count (``cached_tokens`` NULL)."""
    return req.get("cached_tokens") is None


def is_attributable(req: Request) -> bool:
    """True when the request succeeded (status < 400) and missed tokens (prompt_tokens > cached_tokens), or may
    have (a prompt whose cached count was not reported)."""
    if int(req.get("status") or 0) >= 400:
        return False
    if cached_unknown(req):
        return _int(req, "prompt_tokens") > 0
    return _int(req, "prompt_tokens") > _int(req, "cached_tokens")


def can_be_predecessor(req: Request) -> bool:
    """True when a later request could reuse this one's KV blocks: it succeeded with a prompt (a failed
    request, e.g. a 502 when the pod was unreachable, left nothing in any cache)."""
    return int(req.get("status") or 0) < 400 and _int(req, "prompt_tokens") > 0


def _stable_prefix_tokens_raw(req: Request) -> int:
    return sum(_int(req, s.tokens_field) for s in STABLE_SEGMENTS)


# -- step 1: predecessor ------------------------------------------------------------------------------------
def predecessor_keys(req: Request) -> list[tuple[int, tuple[str, ...]]]:
    """``(kind, key)`` for every key on which a later request may find ``req`` (or ``req`` its predecessor).

    Kinds and keys (all scoped by model, because a pod's cache holds one model's KV; conversation, run and
    variants also by tenant, so two tenants' "conv-1" never mix), mirrored by the MATERIALIZED column
    gateway_requests.predecessor_keys (sql/migrations/0008, 0020, 0039, 0043, 0045, 0046):
    9. (tenant, model, agent_run_id, first_message_hash: one thread of the run), 10. (tenant, model,
    conversation_id, first_message_hash: one thread of the conversation), 1. (tenant, model, conversation_id),
    2. (tenant, model, agent_run_id), 14. (tenant, model, cache_salt_hash, system_norm_hash,
    history_prefix_hash), 12. (…, prev_history_hash, prev_suffix_hash) (:data:`KEY_HISTORY`,
    :data:`KEY_PREVIOUS_MESSAGES`), 16. (…, prefill_history_hash) before 12 (:data:`KEY_PREFILL_HISTORY`):
    :data:`PREVIOUS_TURN`, preferred in that order (the same prompt sent after the one a message key found, on the
    fingerprint key, takes its place: a retry or regenerate); 11. (…, history_prefix_hash, suffix_hash), 13. (…,
    next_history_hash) and 15. (…, history_prefix_hash) of a request with ``continue_final_message``
    (:data:`KEY_MESSAGES`, :data:`KEY_MESSAGES_AS_HISTORY`, :data:`KEY_PREFILLED`) are only found, never looked up
    (11 to 16 each when its last hash is not "", and only for a request with neither conversation_id nor
    agent_run_id: a client that sends ids finds its turns on them);
    3. (model, prompt_fingerprint), any tenant, for a non-empty stable prefix; for an empty one (nothing before the
    final message), (model, cache_salt_hash, suffix_hash) when the message holds at least :data:`MIN_HEAD_TOKENS`
    tokens (the same prompt sent again): :data:`FINGERPRINT`;
    4–6. (tenant, model, value) of system_norm_hash, tools_canonical_hash, retrieval_set_hash: :data:`VARIANT`;
    7–8. (tenant, model, line count, first / second half of system_line_hashes) for a system prompt of at least
    :data:`MIN_STRUCTURE_LINES` lines (sql/migrations/0020): :data:`VARIANT`, once :func:`lines_match` confirms
    the candidate (:meth:`PredecessorIndex.candidates`);
    17–18. (tenant, model, conversation_id / agent_run_id, first_message_hash, system_norm_hash): never chosen
    themselves; they replace the turn the id keys found when :func:`same_system_turn` holds
    (:data:`KEY_CONVERSATION_SYSTEM`);
    19. (tenant, model, cache_salt_hash, the final message's first chunk hash), only for an empty stable prefix and a
    first chunk of at least :data:`MIN_HEAD_TOKENS` tokens: :data:`VARIANT` (:data:`KEY_MESSAGE_HEAD`);
    20. (tenant, model, cache_salt_hash, the system prompt's head lines: :func:`system_head`): :data:`VARIANT`,
    taken only when no other variant key found a request (:data:`KEY_SYSTEM_HEAD`).
    """
    tenant, model = _str(req, "tenant_id"), _str(req, "model")
    out: list[tuple[int, tuple[str, ...]]] = []
    for kind, field in ((KEY_CONVERSATION, "conversation_id"), (KEY_AGENT_RUN, "agent_run_id")):
        if _str(req, field):
            out.append((kind, (tenant, model, _str(req, field))))
    if _str(req, "agent_run_id") and _str(req, "first_message_hash"):
        out.append((KEY_AGENT_THREAD, (tenant, model, _str(req, "agent_run_id"), _str(req, "first_message_hash"))))
    if _str(req, "conversation_id") and _str(req, "first_message_hash"):
        out.append((KEY_CONVERSATION_THREAD,
                    (tenant, model, _str(req, "conversation_id"), _str(req, "first_message_hash"))))
    for kind, field in ((KEY_CONVERSATION_SYSTEM, "conversation_id"), (KEY_AGENT_RUN_SYSTEM, "agent_run_id")):
        if _str(req, field) and _str(req, "first_message_hash"):
            out.append((kind, (tenant, model, _str(req, field), _str(req, "first_message_hash"),
                               _str(req, "system_norm_hash"))))
    if not (_str(req, "conversation_id") or _str(req, "agent_run_id")):
        scope = (tenant, model, _str(req, "cache_salt_hash"), _str(req, "system_norm_hash"))
        for kind, names in ((KEY_MESSAGES, ("history_prefix_hash", "suffix_hash")),
                            (KEY_PREVIOUS_MESSAGES, ("prev_history_hash", "prev_suffix_hash")),
                            (KEY_MESSAGES_AS_HISTORY, ("next_history_hash",)),
                            (KEY_HISTORY, ("history_prefix_hash",)), (KEY_PREFILL_HISTORY, ("prefill_history_hash",))):
            if _str(req, names[-1]):
                out.append((kind, (*scope, *(_str(req, f) for f in names))))
        if req.get("continue_final_message") and _str(req, "history_prefix_hash"):
            out.append((KEY_PREFILLED, (*scope, _str(req, "history_prefix_hash"))))
    one_message = _stable_prefix_tokens_raw(req) == 0  # nothing before the final message
    if _str(req, "prompt_fingerprint") and not one_message:
        out.append((KEY_FINGERPRINT, (model, _str(req, "prompt_fingerprint"))))
    elif one_message and _str(req, "suffix_hash") and _int(req, "suffix_tokens") >= MIN_HEAD_TOKENS:
        # the same one-message prompt (sql/migrations/0047)
        out.append((KEY_FINGERPRINT, (model, "suffix", _str(req, "cache_salt_hash"), _str(req, "suffix_hash"))))
    for kind, field in zip(VARIANT_KEYS, VARIANT_FIELDS, strict=False):
        if _str(req, field):
            out.append((kind, (tenant, model, _str(req, field))))
    lines = [str(x) for x in _list(req, LINE_HASHES)]
    if len(lines) >= MIN_STRUCTURE_LINES:
        half = len(lines) // 2
        out.append((KEY_SYSTEM_LINES_HEAD, (tenant, model, str(len(lines)), *lines[:half])))
        out.append((KEY_SYSTEM_LINES_TAIL, (tenant, model, str(len(lines)), *lines[half:])))
    chunks, chunk_tokens = _list(req, CHUNK_HASHES), _list(req, CHUNK_TOKENS)
    if one_message and chunks and chunk_tokens and int(chunk_tokens[0]) >= MIN_HEAD_TOKENS:
        out.append((KEY_MESSAGE_HEAD, (tenant, model, _str(req, "cache_salt_hash"), str(chunks[0]))))
    head = system_head(req)
    if head:
        out.append((KEY_SYSTEM_HEAD, (tenant, model, _str(req, "cache_salt_hash"), *head)))
    return out


def system_head(req: Request) -> tuple[str, ...]:
    """The system prompt's instruction head as key 20 reads it (:data:`KEY_SYSTEM_HEAD`): the hashes of its lines
    before the first blank line (a line of 0 tokens in system_line_tokens), when that line is not the first nor the
    last and the head holds at least :data:`MIN_HEAD_TOKENS` tokens; () otherwise."""
    lines, tokens = _list(req, LINE_HASHES), [int(x) for x in _list(req, LINE_TOKENS)]
    blank = next((i for i, x in enumerate(tokens) if x == 0), -1)
    if len(tokens) != len(lines) or blank < 1 or blank >= len(lines) - 1 or sum(tokens[:blank]) < MIN_HEAD_TOKENS:
        return ()
    return tuple(str(x) for x in lines[:blank])


def match_key(key: tuple[int, tuple[str, ...]]) -> tuple[int, tuple[str, ...]]:
    """The key as matched: each looked-up kind of :data:`MESSAGE_LOOKUPS` shares its found kind's key space
    (hashed alike in SQL, sql/migrations/0045), every other kind has its own."""
    return (MESSAGE_LOOKUPS.get(key[0], key[0]), key[1])


def changed_lines(req: Request, prev: Request) -> int | None:
    """How many system lines differ, position by position, when both requests have the same number of lines,
    at least :data:`MIN_STRUCTURE_LINES`; else None (the structure cannot compare them)."""
    a, b = _list(req, LINE_HASHES), _list(prev, LINE_HASHES)
    if len(a) != len(b) or len(a) < MIN_STRUCTURE_LINES:
        return None
    return sum(x != y for x, y in zip(a, b, strict=True))


def allowed_changed_lines(lines: int) -> int:
    """The most lines of a ``lines``-line system prompt that may differ for a volatile change:
    floor(lines × :data:`VOLATILE_LINE_SHARE`), at least 1."""
    return max(1, int(lines * VOLATILE_LINE_SHARE))


def lines_match(req: Request, prev: Request) -> bool:
    """A banded-key candidate is a predecessor only if the structure confirms it: same line count (≥ 3) and at
    most :func:`allowed_changed_lines` lines differ (0 included)."""
    n = changed_lines(req, prev)
    return n is not None and n <= allowed_changed_lines(len(_list(req, LINE_HASHES)))


def lines_volatile(req: Request, prev: Request) -> bool:
    """The structural volatile rule: :func:`lines_match` with at least one line differing (one line, or a few,
    change each request whatever they hold: a request id of a form the masks do not know)."""
    n = changed_lines(req, prev)
    return n is not None and 1 <= n <= allowed_changed_lines(len(_list(req, LINE_HASHES)))


def other_thread(req: Request, cand: Request) -> bool:
    """Whether ``cand``, the latest request on one of ``req``'s id keys (:data:`ID_TURN_KEYS`), is another thread's
    request, not ``req``'s previous turn: ``req`` is a thread's first call (no history), both logged a
    ``first_message_hash``, and either their first messages and system prompts (``system_hash``) both differ (a new
    sub-agent of the run, with its own system prompt and task) or their normalized system prompts
    (``system_norm_hash``) differ and the lines do not confirm them as one prompt (:func:`lines_match`: a side call
    on the chat's first message under a system prompt of its own, a guardrail, another node of an agent graph; not
    the same first turn sent again with one line of its system prompt changed). A turn with a history is a
    thread's next turn, whatever changed (a sliding window or a compaction that dropped the oldest messages, with a
    system prompt that carries the date or a memory). Such a candidate is dropped
    (:meth:`PredecessorIndex.candidates`); the request then finds its own thread's latest request under its system
    prompt (keys 17, 18), or its predecessor on the fingerprint or variant keys, or none (``cold``), instead of
    reading the other thread's prompt as a ``system_changed`` drift."""
    mine, theirs = _str(req, "first_message_hash"), _str(cand, "first_message_hash")
    if _str(req, "history_prefix_hash") or not (mine and theirs):
        return False
    return (mine != theirs and _str(req, "system_hash") != _str(cand, "system_hash")) or (
        _str(req, "system_norm_hash") != _str(cand, "system_norm_hash") and not lines_match(req, cand))


#: The turn keys of one thread (its first message), tried before the conversation's and the run's latest request.
THREAD_KEYS = (KEY_AGENT_THREAD, KEY_CONVERSATION_THREAD)


def continues(req: Request, cand: Request) -> bool:
    """Whether ``req``'s history carries ``cand`` as its previous turn, as :func:`shared_prefix` reads a previous turn
    (:func:`_history_continues`: its history kept and its final message as sent, re-sent with no reply between, or
    its assistant prefill completed)."""
    return _history_continues(req, Predecessor(cand, PREVIOUS_TURN))


def thread_first(req: Request, thread: Request, latest: Request) -> bool:
    """Whether the latest request of ``req``'s thread (``thread``: on key 9 or 10) is its previous turn rather than the
    latest request of its conversation or run (``latest``, a later one): only when ``req`` continues ``thread`` and
    not ``latest``. A side request of the chat or another thread's turn in between is then skipped; without that
    evidence (a sliding window whose first message repeats an older window's: neither is continued) the latest
    request is the previous turn, as it would be without the thread keys."""
    return continues(req, thread) and not continues(req, latest)


def same_system_turn(req: Request, turn: Request, same: Iterable[Request]) -> Request | None:
    """The request that takes the place of ``turn`` (the previous turn the id keys found for ``req``) as the
    previous turn, or None: when ``turn`` was sent under another normalized system prompt than ``req``, the latest
    of ``same`` (the latest requests of ``req``'s thread under its own system prompt, keys 17 and 18) earlier than
    ``turn`` (by :func:`order_key`). A side call on the chat's messages and id (a guardrail, a judge, another node of
    an agent graph) then stands between two turns of the chat without being either's previous turn, whatever the
    turn does with its history (continues it, regenerates, goes back a turn). Without such a request (the system
    prompt changed for the chat itself) ``turn`` stays: a system drift. A request of ``same`` later than ``turn``
    is no replacement: ``turn`` is then the thread's latest (the thread keys' choice, a side request skipped)."""
    if _str(turn, "system_norm_hash") == _str(req, "system_norm_hash"):
        return None
    earlier = [r for r in same if order_key(r) < order_key(turn)]
    return max(earlier, key=order_key) if earlier else None


#: The turn keys shared by every thread of a conversation or agent run.
SHARED_TURN_KEYS = (KEY_CONVERSATION, KEY_AGENT_RUN)


def choose_predecessor(candidates: Mapping[int, Request]) -> Predecessor | None:
    """The predecessor among ``candidates`` (key kind → the latest earlier request on that key of this
    request, within the horizon): the previous turn of the agent run's thread, else of the conversation's thread,
    else of the conversation, else of the agent run (:data:`TURN_KEYS`); else the fingerprint match; else the
    latest of the variant matches (by :func:`order_key`)."""
    for kind in TURN_KEYS:
        if kind in candidates:
            return Predecessor(candidates[kind], PREVIOUS_TURN)
    if KEY_FINGERPRINT in candidates:
        return Predecessor(candidates[KEY_FINGERPRINT], FINGERPRINT)
    variants = [candidates[k] for k in VARIANT_KEYS if k in candidates]
    if variants:
        return Predecessor(max(variants, key=order_key), VARIANT)
    if KEY_SYSTEM_HEAD in candidates:
        return Predecessor(candidates[KEY_SYSTEM_HEAD], VARIANT)
    return None


class _Timeline:
    """Requests under one key, sorted by :func:`order_key`, for "latest strictly before t" lookups."""

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.reqs: list[Request] = []

    def latest_before(self, ts_ms: int) -> Request | None:
        """The latest request of an earlier millisecond than ``ts_ms``, or None."""
        i = bisect.bisect_left(self.keys, ts_ms * 1048576)  # every request of an earlier millisecond lies before i
        return self.reqs[i - 1] if i else None


class PredecessorIndex:
    """Finds predecessors in memory, over a set of candidate requests (the store-backed job does the same
    lookup in ClickHouse: ingest/attribution_job.py; this is the reference it is tested against).

    ``requests``: every request that may serve as a predecessor; failed ones (status ≥ 400 or
    prompt_tokens = 0) are skipped. ``horizon_seconds``: how far back a predecessor may lie.
    ``lookback_seconds``: how far back a request with no predecessor within the horizon looks for one beyond it
    (≤ ``horizon_seconds``: not at all).
    """

    def __init__(self, requests: Iterable[Request], horizon_seconds: float = DEFAULT_HORIZON_SECONDS,
                 lookback_seconds: float = DEFAULT_LOOKBACK_SECONDS) -> None:
        self.horizon_ms = round(horizon_seconds * 1000)
        self.lookback_ms = max(self.horizon_ms, round(lookback_seconds * 1000))
        self._timelines: dict[tuple[int, tuple[str, ...]], _Timeline] = {}
        seen: set[tuple[str, int]] = set()
        for req in sorted(requests, key=order_key):
            rid = (_str(req, "request_id"), _ts_ms(req))  # a request's identity: a retry under its id is another
            if rid in seen or not can_be_predecessor(req):
                continue
            seen.add(rid)
            for key in predecessor_keys(req):
                if key[0] in MESSAGE_LOOKUPS:
                    continue  # looked up, never found: naming the same previous messages is no previous turn
                tl = self._timelines.setdefault(match_key(key), _Timeline())
                tl.keys.append(order_key(req))
                tl.reqs.append(req)

    def candidates(self, req: Request, reach_ms: int | None = None, beyond_ms: int = 0) -> dict[int, Request]:
        """Key kind → the latest request strictly earlier (an earlier millisecond) on that key, at most
        ``reach_ms`` earlier (default: the horizon) and more than ``beyond_ms`` earlier (the lookback's search
        beyond the horizon: every request within it was considered, and those left were dropped)."""
        ts_ms = _ts_ms(req)
        not_before = ts_ms - (self.horizon_ms if reach_ms is None else reach_ms)
        out: dict[int, Request] = {}
        for key in predecessor_keys(req):
            if key[0] in MESSAGE_FOUND_KINDS:
                continue  # found, never looked up: the same messages are no previous turn
            tl = self._timelines.get(match_key(key))
            found = tl.latest_before(ts_ms - beyond_ms) if tl else None
            if found is not None and _ts_ms(found) >= not_before:
                if key[0] in BAND_KEYS and not lines_match(req, found):
                    continue  # a band matched by chance, the other lines too different: not a variant
                if key[0] in ID_TURN_KEYS and other_thread(req, found):
                    continue  # another thread's (a new sub-agent, a side call's first): not the previous turn
                out[key[0]] = found
        turn = next((k for k in MESSAGE_TURN_KEYS if k in out), None)
        if turn is not None and KEY_FINGERPRINT in out and order_key(out[KEY_FINGERPRINT]) > order_key(out[turn]):
            out[turn] = out[KEY_FINGERPRINT]  # the same prompt sent after the previous turn: a retry or regenerate
        thread = next((out[k] for k in THREAD_KEYS if k in out), None)
        latest = next((out[k] for k in SHARED_TURN_KEYS if k in out), None)
        if thread is not None and latest is not None and order_key(latest) > order_key(thread) and not thread_first(
                req, thread, latest):
            for k in THREAD_KEYS:
                out.pop(k, None)
        same = {k: out.pop(k) for k in SAME_SYSTEM_KEYS if k in out}
        turn = next((k for k in ID_TURN_KEYS if k in out), None)
        if turn is not None and same:
            better = same_system_turn(req, out[turn], same.values())
            if better is not None:
                out[turn] = better
        elif same:  # every id-key candidate was another thread's (other_thread): the thread's own, if any
            kind = max(same, key=lambda k: order_key(same[k]))  # of equal ones, 18's (listed first)
            out[THREAD_OF_SAME_SYSTEM[kind]] = same[kind]
        return out

    def find(self, req: Request) -> Predecessor | None:
        """The predecessor of ``req`` (ts strictly before, at most ``horizon_seconds`` earlier); else, when it
        has none, the one the same rules choose among requests up to ``lookback_seconds`` earlier, marked
        ``beyond_horizon`` (every candidate then lies beyond the horizon: none is within it); else None."""
        pred = choose_predecessor(self.candidates(req))
        if pred is not None or self.lookback_ms <= self.horizon_ms:
            return pred
        pred = choose_predecessor(self.candidates(req, self.lookback_ms, beyond_ms=self.horizon_ms))
        return None if pred is None else Predecessor(pred.request, pred.kind, beyond_horizon=True)


# -- step 2: shared prefix and drift ------------------------------------------------------------------------
def segment_offsets(req: Request) -> tuple[int, ...] | None:
    """Token offsets of the segment boundaries: (0, end of system, of tools, of retrieval, of history = end of
    the stable prefix, prompt_tokens). None when the log has no segment token counts at all.

    Segment counts exclude chat-template tokens (role markers, BOS, the generation prompt), so they sum to
    slightly less than ``prompt_tokens`` (or, with ``token_count_method = estimate``, to something else). The
    cumulative counts are scaled by prompt_tokens / Σ segments and floored, so every segment absorbs template
    tokens in proportion to its size and the last boundary is exactly ``prompt_tokens``.
    """
    counts = [_int(req, s.tokens_field) for s in STABLE_SEGMENTS] + [_int(req, "suffix_tokens")]
    total = sum(counts)
    if total == 0:
        return None
    prompt = _int(req, "prompt_tokens")
    out, cum = [0], 0
    for n in counts:
        cum += n
        out.append(cum * prompt // total)
    return tuple(out)


def _segment_equal(req: Request, prev: Request, seg: Segment) -> bool:
    return _str(req, seg.hash_field) == _str(prev, seg.hash_field)


def _history_continues(req: Request, pred: Predecessor) -> bool:
    """A next turn: the previous turn's messages were re-sent with no reply between (:func:`_sent_without_reply`),
    the previous turn was an assistant prefill this history carries completed (:func:`_prefill_completed`), or
    this request's history as the previous turn saw it equals that turn's history and the message that turn sent
    last is in it as sent (:func:`_previous_message_edited`)."""
    return _sent_without_reply(req, pred) or _prefill_completed(req, pred) or (
        _previous_history_kept(req, pred) and not _previous_message_edited(req, pred))


def _prefill_completed(req: Request, pred: Predecessor) -> bool:
    """The previous turn asked vLLM to continue its final assistant message (``continue_final_message``, logged
    true), and this request's history before its last run of assistant messages is that turn's history
    (``prefill_history_hash`` = its ``history_prefix_hash``, not ""): the reply completed the prefill, and this
    history carries it so. That turn's whole prompt is a prefix of this one (the prefill's tokens begin the
    completed message); ``prev_history_hash``, which drops the user message before the reply, cannot tell."""
    carried = _str(req, "prefill_history_hash")
    return (pred.kind == PREVIOUS_TURN and bool(pred.request.get("continue_final_message")) and carried != ""
            and carried == _str(pred.request, "history_prefix_hash"))


def _sent_without_reply(req: Request, pred: Predecessor) -> bool:
    """This request's history is the previous turn's history and final message, unchanged: its
    ``history_prefix_hash`` equals that turn's ``next_history_hash`` (logged, not ""). A message sent before the
    reply came, or user-only turns: ``prev_history_hash`` assumes a reply between the turns, so it cannot tell."""
    sent = _str(pred.request, "next_history_hash")
    return pred.kind == PREVIOUS_TURN and sent != "" and sent == _str(req, "history_prefix_hash")


def _rewound(req: Request, pred: Predecessor) -> bool:
    """This request goes back one turn: its history is the one the previous turn's own previous turn had
    (``history_prefix_hash`` = the predecessor's ``prev_history_hash``). A chat UI's regenerate of an earlier reply
    or edit of an earlier message re-sends the conversation as it stood then, and the predecessor's prompt holds
    that history (and the final message too, when it is the one the predecessor carried as sent:
    :func:`_rewind_end`). Nothing was cut from the history: no drift, however the predecessor's history ran on."""
    return pred.kind == PREVIOUS_TURN and _str(req, "history_prefix_hash") == _str(pred.request, "prev_history_hash")


def _rewind_end(req: Request, pred: Predecessor, offsets: tuple[int, ...]) -> int:
    """Where the predecessor's prompt stops holding a :func:`_rewound` request's tokens: all of them when its final
    message is the one the predecessor carried (``suffix_hash`` = the predecessor's ``prev_suffix_hash``, logged,
    not "": a regenerated reply; the generation prompt begins that turn's reply in the predecessor), else the end
    of its history (an edited message is new content)."""
    carried = _str(pred.request, "prev_suffix_hash")
    same = carried != "" and carried == _str(req, "suffix_hash")
    return _int(req, "prompt_tokens") if same else offsets[HISTORY + 1]


def _previous_history_kept(req: Request, pred: Predecessor) -> bool:
    return pred.kind == PREVIOUS_TURN and _str(req, "prev_history_hash") == _str(pred.request,
                                                                                  "history_prefix_hash")


def _previous_message_edited(req: Request, pred: Predecessor) -> bool:
    """The previous turn's history is this one's, but its final message is not as it was sent: ``prev_suffix_hash``
    (logged, not "") differs from the previous turn's ``suffix_hash`` (logged, not "": a turn logged without
    segments proves no edit). A log without either reads as continued, and so does a turn
    :func:`_sent_without_reply` (its history holds that message as sent)."""
    carried, sent = _str(req, "prev_suffix_hash"), _str(pred.request, "suffix_hash")
    return (_previous_history_kept(req, pred) and carried != "" and sent != "" and carried != sent
            and not _sent_without_reply(req, pred))


def _predecessor_suffix_in_this_request(req: Request, pred: Predecessor, offsets: tuple[int, ...]) -> int:
    """Where the predecessor's final message started, in this request's tokens: its own suffix offset shifted by
    the change in length of the segments before the history (as :func:`_predecessor_prompt_in_this_request`);
    this request's history start when the predecessor has no segment counts."""
    p_offsets = segment_offsets(pred.request)
    if p_offsets is None:
        return offsets[HISTORY]
    return p_offsets[HISTORY + 1] + _shift_before_history(req, pred)


def _shift_before_history(req: Request, pred: Predecessor) -> int:
    """How many tokens longer the segments before the history are in ``req`` than in the predecessor (raw segment
    counts: template tokens are the same on both sides)."""
    return sum(_int(req, s.tokens_field) - _int(pred.request, s.tokens_field) for s in STABLE_SEGMENTS[:HISTORY])


def _predecessor_prompt_in_this_request(req: Request, pred: Predecessor) -> int:
    """Where the predecessor's whole prompt ends in this request's tokens when the conversation continued
    (its history, suffix and generation prompt are all in this request's history) but an earlier segment
    changed: its prompt_tokens shifted by the change in length of the segments before the history (template
    tokens are the same on both sides, so raw segment counts are exact here)."""
    return _int(pred.request, "prompt_tokens") + _shift_before_history(req, pred)


def _name_drift(req: Request, prev: Request, seg: Segment) -> str:
    """Sub-cause for a segment whose raw hash differs (docs/miss-causes.md: named by the variant hashes; a variant the
    gateway left empty proves nothing, so it names the change, not a reordering). A system prompt whose normalized
    hash differs is next read for retrieved documents after an unchanged instruction head
    (:func:`system_document_drift`: rag_reordered / rag_changed), then is volatile when its structure says so
    (:func:`lines_volatile`), whatever the changed lines hold."""
    variant = _str(req, seg.variant_field) if seg.variant_field else ""
    if variant and variant == _str(prev, seg.variant_field):
        return seg.reordered
    if seg.name == "system":
        documents, _, _ = system_document_drift(req, prev)
        if documents:
            return documents
        if lines_volatile(req, prev):
            return seg.reordered
    return seg.changed


def _scaled(req: Request, raw: int) -> int:
    """A position counted in raw segment tokens, scaled to prompt tokens as :func:`segment_offsets` scales the
    segment boundaries (floor(raw × prompt_tokens / Σ segment tokens))."""
    total = sum(_int(req, s.tokens_field) for s in STABLE_SEGMENTS) + _int(req, "suffix_tokens")
    return raw * _int(req, "prompt_tokens") // total if total else 0


def first_changed_line_tokens(req: Request, prev: Request) -> int:
    """Raw tokens of the system lines before the first line that differs from the predecessor's (position by
    position; when one list is a prefix of the other, the first line past the shorter), at most system_tokens;
    0 when either side has no line structure or none differs (the change is then placed at token 0)."""
    a, b = _list(req, LINE_HASHES), _list(prev, LINE_HASHES)
    if not a or not b:
        return 0
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if first == len(a) == len(b):
        return 0
    return min(sum(int(t) for t in _list(req, LINE_TOKENS)[:first]), _int(req, "system_tokens"))


def suffix_chunk_drift(req: Request, prev: Request) -> tuple[int, str, int]:
    """(P, sub, E) for a suffix that differs from the predecessor's, from their content-defined chunks h (this
    request's, tokens t) and p (the predecessor's), all in raw suffix tokens:

    - k = length of the common ordered chunk prefix (h[i] = p[i] for i < k); P = Σ t[:k], shared;
    - a chunk h[i], k ≤ i < len(h) − 1 (never the final chunk: the question), is *known* when the predecessor's
      suffix had it anywhere (p as a set); j = the last known one. None: no drift (sub "", E = P);
    - guard: the known chunks of h[k..j] must hold at least as many tokens as the new ones among them, and one of
      them at least :data:`MIN_HEAD_TOKENS` (a block: a document, not a rule line or closing tag that frames
      any text), else no drift (new content that repeats a paragraph or a separator by chance stays unavoidable);
    - sub = rag_reordered when the chunks h[k..j] and the predecessor's chunks after the common prefix but
      its final one (p[k : len(p) − 1]) are the same set, else rag_changed (documents replaced while others
      stayed); E = Σ t[:j + 1], the end of the drift. Chunks after j (new documents, the question) stay
      unavoidable.
    """
    h, p = _list(req, CHUNK_HASHES), _list(prev, CHUNK_HASHES)
    t = [int(x) for x in _list(req, CHUNK_TOKENS)]
    k = next((i for i, (x, y) in enumerate(zip(h, p, strict=False)) if x != y), min(len(h), len(p)))
    shared = sum(t[:k])
    had = set(p)
    known = [i for i in range(k, len(h) - 1) if h[i] in had]
    if not known:
        return shared, "", shared
    j = known[-1]
    known_tokens = [t[i] for i in range(k, j + 1) if h[i] in had]
    if 2 * sum(known_tokens) < sum(t[k:j + 1]) or max(known_tokens) < MIN_HEAD_TOKENS:
        return shared, "", shared
    sub = RAG_REORDERED if set(h[k:j + 1]) == set(p[k:len(p) - 1]) else RAG_CHANGED
    return shared, sub, sum(t[:j + 1])


def system_document_drift(req: Request, prev: Request) -> tuple[str, int, bool]:
    """(sub, E, new_after) for retrieved documents inside the system prompt (LangChain's "stuff documents" prompt: a
    fixed instruction head, a blank line, then the documents, one paragraph each), from the system lines a (this
    request's hashes, tokens t) and b (the predecessor's), E in raw system tokens. A blank line is one of 0 tokens.

    - k = the first line that differs, position by position (as :func:`first_changed_line_tokens`); the rule needs
      k ≥ 1 with line k − 1 blank: the change starts a paragraph after an unchanged head (a changed first paragraph
      is the instructions, ``system_changed`` or volatile as before);
    - every line of the paragraph that starts at k (up to the next blank line) differs position by position: a
      whole paragraph was replaced or moved (a volatile line inside a paragraph, its other lines in place, is no
      document: :func:`lines_volatile` reads it);
    - a non-blank line at or after k is *known* when the predecessor's system prompt had it anywhere (b as a set);
      j = the last known one; none: no documents (sub ""); and some known line must sit elsewhere than in the
      predecessor (documents moved: reordered, inserted or dropped before it). Paragraphs replaced in place, every
      known line where it was, are the line rules' (a volatile block of ids, a memory summary, a user profile, a
      policy paragraph: the structure cannot tell them from one replaced document);
    - guard, as :func:`suffix_chunk_drift`: the known lines of a[k..j] hold at least half of its tokens and one of
      them at least :data:`MIN_HEAD_TOKENS`; and the new (unknown, non-blank) lines among them hold none or at least
      MIN_HEAD_TOKENS (a document, not a short id or date line of its own);
    - sub = rag_reordered when the non-blank lines of a[k..j] and of b[k:] are the same set, else rag_changed;
      E = Σ t[:j + 1]; new_after: a non-blank line after j that the predecessor did not have (new content, where
      the drift ends).
    """
    a, b = [str(x) for x in _list(req, LINE_HASHES)], [str(x) for x in _list(prev, LINE_HASHES)]
    t = [int(x) for x in _list(req, LINE_TOKENS)]
    if not a or not b or len(t) != len(a):
        return "", 0, False
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if k < 1 or k >= len(a) or t[k - 1] != 0:
        return "", 0, False
    end = next((i for i in range(k, len(a)) if t[i] == 0), len(a))
    if any(i < len(b) and a[i] == b[i] for i in range(k, end)):
        return "", 0, False
    had = set(b)
    known = [i for i in range(k, len(a)) if t[i] > 0 and a[i] in had]
    if not known:
        return "", 0, False
    j = known[-1]
    if all(i < len(b) and a[i] == b[i] for i in known):
        return "", 0, False  # nothing the predecessor had moved: paragraphs replaced in place (the line rules')
    known_tokens = [t[i] for i in known if i <= j]
    new_tokens = sum(t[i] for i in range(k, j + 1) if a[i] not in had)
    if (2 * sum(known_tokens) < sum(t[k:j + 1]) or max(known_tokens) < MIN_HEAD_TOKENS
            or 0 < new_tokens < MIN_HEAD_TOKENS):
        return "", 0, False
    blank = {a[i] for i in range(len(a)) if t[i] == 0}
    same = {a[i] for i in range(k, j + 1) if t[i] > 0} == set(b[k:]) - blank
    new_after = any(t[i] > 0 and a[i] not in had for i in range(j + 1, len(a)))
    return RAG_REORDERED if same else RAG_CHANGED, sum(t[:j + 1]), new_after


def head_only(req: Request, pred: Predecessor) -> bool:
    """Whether ``pred`` shares nothing nameable with ``req`` but the system prompt's instruction head: a
    :data:`VARIANT` with the same :func:`system_head` (non-empty), whose normalized system prompt differs, whose
    lines do not confirm it (:func:`lines_match`), and whose canonical tools and retrieval set are not ``req``'s: it
    was found on key 20 (:data:`KEY_SYSTEM_HEAD`) alone, and no non-blank line after the head is one the
    predecessor's system prompt had. What follows the head is then new content: another request's documents are not
    a changed system prompt (the same head with other documents had no predecessor before key 20 and read cold). A
    line after the head that the predecessor had (a document reordered under a title line, a trailer line) is left
    to the drift rules (:func:`system_document_drift`, else the system prompt's drift)."""
    prev = pred.request
    if pred.kind != VARIANT or not system_head(req) or system_head(req) != system_head(prev):
        return False
    if _str(req, "system_norm_hash") == _str(prev, "system_norm_hash") or lines_match(req, prev):
        return False
    lines, tokens, had = _list(req, LINE_HASHES), [int(x) for x in _list(req, LINE_TOKENS)], set(
        str(x) for x in _list(prev, LINE_HASHES))
    blank = tokens.index(0)  # system_head found one
    if any(tokens[i] > 0 and str(lines[i]) in had for i in range(blank + 1, len(lines))):
        return False  # a line after the head is the predecessor's: not new content (the drift rules read it)
    return not any(_str(req, f) and _str(req, f) == _str(prev, f) for f in ("tools_canonical_hash",
                                                                              "retrieval_set_hash"))


def _reusable_without_drift(req: Request, pred: Predecessor, offsets: tuple[int, ...], first: int) -> int:
    """W: walk on past the drifted segment ``first``, counting later segments that are raw-equal or differ
    only in a nameable way (variant-equal, or a continued history); stop at the first that is new content."""
    prev = pred.request
    prompt = _int(req, "prompt_tokens")
    for i in range(first + 1, len(STABLE_SEGMENTS)):
        seg = STABLE_SEGMENTS[i]
        if _segment_equal(req, prev, seg):
            continue
        if i == HISTORY:
            if _history_continues(req, pred):
                return min(prompt, _predecessor_prompt_in_this_request(req, pred))
            if _previous_message_edited(req, pred):  # kept up to the edited message
                return min(prompt, max(offsets[i], _predecessor_suffix_in_this_request(req, pred, offsets)))
            if _rewound(req, pred):
                return min(prompt, _rewind_end(req, pred, offsets))
            return offsets[i]
        if _str(req, seg.variant_field) and _str(req, seg.variant_field) == _str(prev, seg.variant_field):
            continue
        return offsets[i]
    return prompt if _str(req, "suffix_hash") == _str(prev, "suffix_hash") else offsets[HISTORY + 1]


def shared_prefix(req: Request, pred: Predecessor) -> SharedPrefix | None:
    """Shared length S and the drift, in tokens of ``req`` (see :class:`SharedPrefix`). None when ``req`` has
    no segment token counts (positions cannot be placed).

    Walk system, tools, retrieval, history, suffix; a segment counts while its raw hash equals the
    predecessor's (an empty segment on both sides is equal). At the first that differs:
    - system/tools/retrieval: drift named by the variant (norm / canonical / set equal → volatile_system /
      tools_reordered / rag_reordered, else system_changed / tools_changed / rag_changed); the system prompt is
      also volatile_system when its line structure says so (:func:`lines_volatile`), and its drift starts at
      the first changed line (:func:`first_changed_line_tokens`), not at token 0;
    - history, previous-turn predecessor: if ``prev_history_hash`` equals the predecessor's
      ``history_prefix_hash``, or this ``history_prefix_hash`` equals the predecessor's ``next_history_hash``
      (sent with no reply between), the conversation continued and S covers the predecessor's whole prompt (its
      history and suffix are in this history), unless ``prev_suffix_hash`` says the predecessor's final message
      is not in it as sent: ``history_changed`` from where that message starts (the predecessor's suffix
      offset) to the predecessor's prompt end (at most this history's end); if this ``history_prefix_hash``
      equals the predecessor's ``prev_history_hash``, the request went back one turn (a regenerate or an edit of
      an earlier message: :func:`_rewound`), no drift, S up to its history's end (its whole prompt when its final
      message is the predecessor's ``prev_suffix_hash``); else ``history_truncated``;
    - history, fingerprint or variant predecessor: different history is another conversation's content, not a
      change: S ends there, no drift;
    - suffix: the new message; S ends at the stable prefix plus the suffix's common ordered chunk prefix (all
      of the prompt when the suffix is equal too); retrieved documents inside it that were reordered or
      replaced are a rag_reordered / rag_changed drift (:func:`suffix_chunk_drift`).
    S never exceeds the predecessor's prompt_tokens (nothing beyond it was cached). When the changed segment is
    one the predecessor did not have (tools, documents or a system prompt added before content it had), neither
    does W: the added segment is new content (``unavoidable``); the drift is what it displaced, at most the rest
    of the predecessor's prompt.

    A previous turn sent under another ``cache_salt`` (``cache_salt_hash`` differs) shares nothing: vLLM keys the
    salt into the first block, so S = 0 with drift :data:`CACHE_SALT_CHANGED` at token 0, and W is what the walk
    above gives (how far the prompt would have been reused under the same salt). A fingerprint or variant
    predecessor always has the request's salt (the gateway salts those keys: docs/gateway-log.md).
    """
    shared = _shared_prefix(req, pred)
    if shared is None:
        return None
    if salt_changed(req, pred):
        return SharedPrefix(0, CACHE_SALT_CHANGED, 0, shared.reusable_without_drift_tokens)
    chain = chain_shared(req.get("prompt_block_hashes"), req.get("prompt_block_size"),
                         pred.request.get("prompt_block_hashes"), pred.request.get("prompt_block_size"))
    return chain_bounded(shared, chain, _int(req, "prompt_tokens"), _int(pred.request, "prompt_tokens"))


def chain_shared(chain: Sequence[int] | None, block_size: int | None, pred_chain: Sequence[int] | None,
                 pred_block_size: int | None) -> tuple[int, bool] | None:
    """What two logged block chains (gateway_requests.prompt_block_hashes: one hash per full block of the prompt's
    token ids, each over its parent's hash and the block's tokens, as vLLM hashes blocks; docs/kv-events.md) prove
    the prompts share: (tokens, covers) with tokens = k·block_size for the k leading blocks whose hashes are equal,
    and covers true when those are all the predecessor's full blocks. None when either prompt logged no chain or
    the two block sizes differ. Chained hashes make equal hashes at a position equal prefixes up to it, whatever
    the chat template printed: fields the gateway's segment hashes see but the template does not (a tool call's
    id, a message's ``name``, ``content: null`` against ``""``, a document's score) change no token."""
    if not chain or not pred_chain or not block_size or block_size != pred_block_size:
        return None
    k = 0
    for a, b in zip(chain, pred_chain, strict=False):
        if a != b:
            break
        k += 1
    return k * int(block_size), k == len(pred_chain)


def chain_bounded(shared: SharedPrefix, chain: tuple[int, bool] | None, prompt_tokens: int,
                  pred_prompt_tokens: int) -> SharedPrefix:
    """``shared`` (the segments' verdict) bounded by what the block chains prove (:func:`chain_shared`): a drift the
    segment hashes claim before the first block whose hash differs is not in the tokens vLLM saw. When the chains
    share every full block of the predecessor, there is no drift: the predecessor's prompt is shared, as for a
    continued conversation. Otherwise the drift starts at the first differing block (exact, where the segments'
    boundaries are estimates: a one-line system prompt whose timestamp sits at its end drifts in its last block,
    not from its start). A cache_salt change is kept as it is (the salt keys the first block). Unchanged without
    a drift or a chain, or when the chains prove no more than the segments."""
    if chain is None or not shared.drift_sub_cause or shared.drift_sub_cause == CACHE_SALT_CHANGED:
        return shared
    tokens, covers = chain
    cap = min(prompt_tokens, pred_prompt_tokens)
    if covers:
        return SharedPrefix(cap, reusable_without_drift_tokens=cap)
    if tokens <= shared.shared_tokens:
        return shared
    return SharedPrefix(tokens, shared.drift_sub_cause, tokens, max(tokens, shared.reusable_without_drift_tokens))


def salt_changed(req: Request, pred: Predecessor) -> bool:
    """The predecessor is the previous turn and was sent under another vLLM ``cache_salt`` than ``req``."""
    return pred.kind == PREVIOUS_TURN and _str(req, "cache_salt_hash") != _str(pred.request, "cache_salt_hash")


def _shared_prefix(req: Request, pred: Predecessor) -> SharedPrefix | None:
    """:func:`shared_prefix` by the segments alone, whatever the salts."""
    offsets = segment_offsets(req)
    if offsets is None:
        return None
    prev = pred.request
    prompt = _int(req, "prompt_tokens")
    cap = min(prompt, _int(prev, "prompt_tokens"))
    for i, seg in enumerate(STABLE_SEGMENTS):
        if _segment_equal(req, prev, seg):
            continue
        if i == HISTORY:
            if _history_continues(req, pred):
                # Everything before the history is raw-equal, so the predecessor's prompt is exactly this
                # prompt's first prompt_tokens(predecessor) tokens.
                return SharedPrefix(cap, reusable_without_drift_tokens=cap)
            if _previous_message_edited(req, pred):
                # the same up to the previous turn's final message, which is where the predecessor's suffix
                # started; had it been kept, the predecessor's whole prompt would have been shared
                d = min(cap, _predecessor_suffix_in_this_request(req, pred, offsets))
                return SharedPrefix(d, HISTORY_CHANGED, d, max(d, min(cap, offsets[HISTORY + 1])))
            if _rewound(req, pred):  # back one turn (regenerate, edit): the predecessor holds this history
                s = min(cap, _rewind_end(req, pred, offsets))
                return SharedPrefix(s, reusable_without_drift_tokens=s)
            if pred.kind != PREVIOUS_TURN:
                s = min(cap, offsets[i])
                return SharedPrefix(s, reusable_without_drift_tokens=s)
        d = min(cap, offsets[i] if i else _scaled(req, first_changed_line_tokens(req, prev)))
        if i == 0 and head_only(req, pred) and not system_document_drift(req, prev)[0]:
            return SharedPrefix(d, reusable_without_drift_tokens=d)  # the head shared, the rest new content
        w = _reusable_without_drift(req, pred, offsets, i)
        if i == 0:
            documents, end, new_after = system_document_drift(req, prev)
            if documents and new_after and _str(req, "system_norm_hash") != _str(prev, "system_norm_hash"):
                w = _scaled(req, end)  # documents the predecessor did not have follow: new content from there
        if i < HISTORY and not _str(prev, seg.hash_field):  # an added segment: W ≤ the predecessor's prompt
            w = min(cap, w)
        w = max(d, w)
        return SharedPrefix(d, _name_drift(req, prev, seg), d, w)
    if _str(req, "suffix_hash") == _str(prev, "suffix_hash"):
        return SharedPrefix(cap, reusable_without_drift_tokens=cap, identical=True)
    stable, suffix = _stable_prefix_tokens_raw(req), _int(req, "suffix_tokens")
    shared, sub, end = suffix_chunk_drift(req, prev)
    s = min(cap, _scaled(req, stable + min(shared, suffix)))
    if not sub:
        return SharedPrefix(s, reusable_without_drift_tokens=s)
    return SharedPrefix(s, sub, s, max(s, _scaled(req, stable + min(end, suffix))))


# -- step 3: token split ------------------------------------------------------------------------------------
def split_missed_tokens(*, prompt_tokens: int, cached_tokens: int, block_size: int,
                        stable_prefix_tokens: int | None, shared: SharedPrefix | None,
                        reuse_cause: tuple[str, str] = (EVICTED, ""),
                        evidence_zones: Iterable[tuple[int, str, str]] = ()) -> list[tuple[str, str, int]]:
    """Split the missed tokens [C, P) (C = cached_tokens, P = prompt_tokens) into (cause, sub_cause, tokens),
    in prompt order, one entry per (cause, sub_cause); the tokens sum exactly to P − C (empty when ≤ 0).

    B = ``block_size`` (tokens); L = floor((P − 1)/B)·B, the most vLLM can hit. ``stable_prefix_tokens`` (T):
    where the suffix starts, None when the log has no segment counts; ``shared``: from :func:`shared_prefix`,
    None without a predecessor; ``reuse_cause``: the cause of reusable-but-missed tokens (routed_away,
    evicted with its sub_cause, or beyond_horizon). ``evidence_zones``: precise mode's block-exact zones
    (:func:`kv_evidence_zones`, (end, cause, sub_cause), ends at block boundaries up to E·B); they come first,
    so every later zone starts at E·B at the earliest. Zones cover [0, P) without overlap, each counted on its
    part of [C, P), first rule that applies:
    - C > L: vLLM cannot hit that much with this B, so the numbers (or B) are wrong: all ``unknown``;
    - L = 0 (P − 1 < B, a prompt shorter than one block plus its last token): nothing of it can ever hit,
      whatever came before: [0, P − 1) ``below_block``, the last token ``unavoidable``;
    - precise mode: ``evidence_zones`` over [C, E·B), block by block, then the rules below from E·B on;
    - no segment counts: [0, L) ``unknown``;
    - no predecessor, 0 < T < B: [0, T) ``below_block`` (the shareable prefix is shorter than a block);
      else [0, floor(min(T, P−1)/B)·B) ``cold``; a hit C > 0 here is a short common opening (the chat
      template's first tokens, a shared greeting) that some earlier prompt had: the missed rest of the prefix
      was still never seen;
    - predecessor, 0 < S < B: [0, S) ``below_block``;
      predecessor, S ≥ B (or 0): [0, R) with R = floor(min(S, P−1)/B)·B → ``reuse_cause`` (the part below C
      was hit, so only [C, R) counts); a hit that ends within one block of R (0 < C, R − B ≤ C < R) is taken
      as the edge of sharing (the estimated segment boundary may overshoot the real one by a few template
      tokens), so R = C and that block falls to the next zone; without any hit (C = 0) there is no edge and
      the whole of [0, R) is ``reuse_cause``; nor is there one for an identical prompt (``shared.identical``: S
      is exact, vLLM hits all of L when every block is still there), so a hit that stops short of it, even by
      one block, lost the blocks after it (vLLM's LRU frees a request's last block first);
    - drift (S is then where the changed segment starts): from there to floor(min(W, P−1)/B)·B
      ``prefix_drift``/sub: this includes the partial block before the change point, which the change broke.
      So a prefix both reusable elsewhere and drifted is split by position: the blocks before the change to
      ``reuse_cause``, from the change on to the drift;
    - the rest (new suffix or new turn, the last partial block, the last token): ``unavoidable``.
    """
    p, c, b = max(0, prompt_tokens), max(0, cached_tokens), max(1, block_size)
    if p - c <= 0:
        return []
    last_hittable = _full_blocks(p - 1, b)
    if c > last_hittable:
        return [(UNKNOWN, "", p - c)]
    zones: list[tuple[int, str, str]] = []  # (end, cause, sub_cause); each starts where the previous ended
    if last_hittable == 0:
        zones.append((p - 1, BELOW_BLOCK, ""))
    else:
        zones.extend((min(end, last_hittable), cause, sub) for end, cause, sub in evidence_zones)
        zones.extend(_fingerprint_zones(p, c, b, stable_prefix_tokens, shared, reuse_cause))
    zones.append((p, UNAVOIDABLE, ""))

    totals: dict[tuple[str, str], int] = {}
    start = 0
    for end, cause, sub in zones:
        end = max(start, end)
        n = max(0, end - max(start, c))
        if n:
            totals[(cause, sub)] = totals.get((cause, sub), 0) + n
        start = end
    out = [(cause, sub, n) for (cause, sub), n in totals.items()]
    assert sum(n for _, _, n in out) == p - c, (prompt_tokens, cached_tokens, zones)
    return out


def _fingerprint_zones(p: int, c: int, b: int, stable_prefix_tokens: int | None, shared: SharedPrefix | None,
                       reuse_cause: tuple[str, str]) -> list[tuple[int, str, str]]:
    """The zones the segment fingerprints place before the unavoidable rest, for L > 0 (see
    :func:`split_missed_tokens`): unknown without segment counts, cold / below_block without a predecessor,
    else :func:`_predecessor_zones`."""
    if stable_prefix_tokens is None:
        return [(_full_blocks(p - 1, b), UNKNOWN, "")]
    if shared is None:
        t = min(max(0, stable_prefix_tokens), p - 1)
        return [(t, BELOW_BLOCK, "") if 0 < t < b else (_full_blocks(t, b), COLD, "")]
    return _predecessor_zones(p, c, b, shared, reuse_cause)


def _predecessor_zones(p: int, c: int, b: int, shared: SharedPrefix,
                       reuse_cause: tuple[str, str]) -> list[tuple[int, str, str]]:
    """The zones before the unavoidable rest when there is a predecessor (see :func:`split_missed_tokens`):
    the shared part (below_block, or reusable up to R), then the drift up to W."""
    zones: list[tuple[int, str, str]] = []
    s = min(max(0, shared.shared_tokens), p)
    if 0 < s < b:
        zones.append((min(s, p - 1), BELOW_BLOCK, ""))
    else:
        r = _full_blocks(min(s, p - 1), b)
        if 0 < c < r and r - b <= c and not shared.identical:
            # A hit that stops within the last block before R: segment boundaries are placed by scaling
            # (template tokens are spread), so that block may straddle the real end of the shared part;
            # it is the edge of sharing, not a lost prefix (routed_away/evicted need at least a block).
            # An identical prompt has no estimated boundary: its S is exact.
            r = c
        zones.append((r, *reuse_cause))
    if shared.drift_sub_cause:
        w = _full_blocks(min(shared.reusable_without_drift_tokens, p - 1), b)
        zones.append((w, PREFIX_DRIFT, shared.drift_sub_cause))
    return zones


# -- per request and per batch ------------------------------------------------------------------------------
def pods_down(req: Request) -> frozenset[str]:
    """The pods the gateway found down when it routed ``req`` (gateway_requests.pods_down; empty when not logged)."""
    return frozenset(str(p) for p in req.get("pods_down") or ())


def _reuse_cause(req: Request, pred: Predecessor) -> tuple[str, str]:
    """beyond_horizon when the predecessor lies beyond the horizon; else routed_away when another pod served
    it (sub_cause ``pod_down`` when that pod was down as the request was routed: :func:`pods_down`); evicted
    when this pod did (and lost it)."""
    if pred.beyond_horizon:
        return (BEYOND_HORIZON, "")
    if _str(pred.request, "pod") != _str(req, "pod"):
        return (ROUTED_AWAY, POD_DOWN if _str(pred.request, "pod") in pods_down(req) else "")
    return (EVICTED, EVICTED_BEFORE_NEXT_TURN if pred.kind == PREVIOUS_TURN else "")


def kv_evidence_zones(cached_tokens: int, block_size: int, evidence: KvEvidence,
                      previous_turn: bool, down: frozenset[str] = frozenset()) -> list[tuple[int, str, str]]:
    """Precise mode's zones (end, cause, sub_cause) over [C, E·B), one per block, exact to the block (no edge
    tolerance): block j = k0 + i (k0 = C // B) of ``evidence.blocks`` covers [j·B, (j+1)·B) and is
    - :data:`REMOVED_HERE` → ``evicted`` (sub_cause ``evicted_before_next_turn`` when ``previous_turn``: the
      predecessor is the previous turn of the conversation or agent run, else "");
    - :data:`RESET_HERE` → ``evicted`` / :data:`CACHE_RESET`;
    - :data:`RESIDENT_ELSEWHERE` → ``routed_away`` (sub_cause ``pod_down`` when its holder is in ``down``, the pods
      found down as the request was routed: the holder named is one that was up whenever one was,
      :meth:`ingest.kv_evidence.KvTimeline.status`);
    - :data:`RESIDENT_HERE` → ``unknown`` / :data:`RESIDENT_AT_ARRIVAL` (resident here, missed all the same);
    E is the first :data:`NOWHERE` block (or the end of ``blocks``): from E·B on the fingerprints decide."""
    b = max(1, block_size)
    evicted_sub = EVICTED_BEFORE_NEXT_TURN if previous_turn else ""
    named = {REMOVED_HERE: (EVICTED, evicted_sub), RESET_HERE: (EVICTED, CACHE_RESET),
             RESIDENT_ELSEWHERE: (ROUTED_AWAY, ""), RESIDENT_HERE: (UNKNOWN, RESIDENT_AT_ARRIVAL)}
    zones: list[tuple[int, str, str]] = []
    for j, status in enumerate(evidence.blocks, start=max(0, cached_tokens) // b):
        if status.state not in named:
            break
        held_by_down = status.state == RESIDENT_ELSEWHERE and status.pod in down
        zones.append(((j + 1) * b, *((ROUTED_AWAY, POD_DOWN) if held_by_down else named[status.state])))
    return zones


def drift_first(zones: list[tuple[int, str, str]], shared: SharedPrefix | None, prompt_tokens: int,
                block_size: int) -> list[tuple[int, str, str]]:
    """Precise mode's zones cut where the fingerprints' drift begins: the blocks ending at or before
    floor(min(D, P − 1)/B)·B (D = ``shared.shared_tokens``, where the changed segment starts), all of them
    when the predecessor shows no drift. From the change point on the prompt is new content compared with its
    predecessor: that a block of it is resident on another pod (another conversation sent the same reordered
    documents or tools there) or was removed here does not make its miss a routing or eviction loss; the drift
    caused it (docs/miss-causes.md, "Two causes in one request")."""
    if shared is None or not shared.drift_sub_cause:
        return zones
    cut = _full_blocks(min(max(0, shared.shared_tokens), prompt_tokens - 1), max(1, block_size))
    return [z for z in zones if z[0] <= cut]


def _precise_reuse_cause(reuse: tuple[str, str], req: Request, pred: Predecessor, evidence: KvEvidence
                         ) -> tuple[str, str]:
    """The fingerprints' reuse cause for the part after E·B in precise mode: the blocks there were resident on
    no pod at arrival, so a predecessor on a pod whose KV events cover the arrival cannot have left them
    there: ``cold`` instead of routed_away / evicted. beyond_horizon, and a predecessor on a pod without KV
    events, keep the fingerprints' cause."""
    if reuse[0] in (ROUTED_AWAY, EVICTED) and _str(pred.request, "pod") in evidence.covered_pods:
        return (COLD, "")
    return reuse


def _evidence_fields(evidence: KvEvidence | None, split: list[tuple[str, str, int]], zones: bool = True
                     ) -> tuple[str, str, datetime | None]:
    """(evidence, evidence_pod, evidence_removed_at) of a verdict: kv_events with the first missed block's
    holder and departure when judged with ``evidence`` (no holder when ``zones`` is false: no block was
    decided by the evidence); else inferred when a routed_away / evicted part exists, else fingerprints."""
    if evidence is not None:
        first = evidence.blocks[0] if evidence.blocks and zones else BlockStatus(NOWHERE)
        return EVIDENCE_KV_EVENTS, first.pod, first.removed_at
    if any(cause in (ROUTED_AWAY, EVICTED) for cause, _, _ in split):
        return EVIDENCE_INFERRED, "", None
    return EVIDENCE_FINGERPRINTS, "", None


@dataclass(frozen=True)
class Verdict:
    """The answer for one request: one request_attribution row (sql/migrations/0009).

    ``causes``/``sub_causes``/``missed_tokens``: parallel tuples, one entry per (cause, sub_cause) in prompt
    order, the tokens summing to prompt_tokens − cached_tokens (empty when the request failed or missed
    nothing); ``cached_tokens`` None (not reported): one :data:`NOT_REPORTED` entry with all prompt tokens.
    ``predecessor_*``: the earlier request it could have reused blocks from ("" if none; kept for a full hit
    too, for affinity); ``predecessor_kind``: :attr:`Predecessor.stored_kind` (e.g. ``fingerprint``, or
    ``fingerprint_beyond_horizon``); ``gap_ms``: predecessor end (its ts + e2e_ms) → this ts, ms (None without
    predecessor); ``block_size``: tokens per KV block used for this request's pod. ``evidence``: one of
    :data:`EVIDENCES`; ``evidence_pod``: the pod that held the first missed block in precise mode (the holder
    for routed_away, this pod for evicted), "" otherwise; ``evidence_removed_at``: when that block left this
    pod (aware UTC), None otherwise.
    """

    request_id: str
    ts: datetime
    tenant_id: str
    pod: str
    model: str
    prompt_tokens: int
    cached_tokens: int | None
    predecessor_request_id: str
    predecessor_pod: str
    predecessor_kind: str
    gap_ms: float | None
    block_size: int
    causes: tuple[str, ...] = ()
    sub_causes: tuple[str, ...] = ()
    missed_tokens: tuple[int, ...] = ()
    evidence: str = EVIDENCE_FINGERPRINTS
    evidence_pod: str = ""
    evidence_removed_at: datetime | None = None

    def values(self) -> tuple[Any, ...]:
        """Values in :data:`VERDICT_COLUMNS` order."""
        return astuple(self)

    def rows(self) -> list[MissRow]:
        """The verdict as one :class:`MissRow` per (cause, sub_cause), in prompt order."""
        return [MissRow(self.request_id, self.ts, self.tenant_id, self.pod, self.model, cause, sub, tokens,
                        self.predecessor_request_id, self.predecessor_pod, self.gap_ms, self.block_size)
                for cause, sub, tokens in zip(self.causes, self.sub_causes, self.missed_tokens, strict=True)]


VERDICT_COLUMNS = tuple(f.name for f in fields(Verdict))


def judge(req: Request, pred: Predecessor | None, block_size: int, evidence: KvEvidence | None = None) -> Verdict:
    """The verdict for one request. ``block_size``: tokens per KV block on the request's pod.

    A failed request (status ≥ 400) gets no predecessor and no causes, nor does one of 0 prompt tokens (neither can
    be a predecessor: :func:`can_be_predecessor`; so a late row never changes what they name); a request that
    missed nothing keeps
    its predecessor and gets no causes; a request whose cached count was not reported keeps its predecessor
    (when it has segment counts) and gets one cause, :data:`NOT_REPORTED`, for all its prompt tokens: which
    of them missed, and why, cannot be told.

    ``evidence``: precise mode (docs/miss-causes.md "Precise mode"): the status of each missed block at
    arrival from the KV events; used only for an attributable request with a known cached count and
    ``evidence.block_size == block_size``. Its blocks give [C, E·B) (:func:`kv_evidence_zones`); the
    fingerprints decide from E·B on, with routed_away / evicted there read as ``cold``
    (:func:`_precise_reuse_cause`). Without it, routed_away / evicted are inferred from the predecessor's pod.
    """
    if not can_be_predecessor(req):
        pred = None
    offsets = segment_offsets(req)
    split: list[tuple[str, str, int]] = []
    zones: list[tuple[int, str, str]] = []
    precise = (evidence is not None and evidence.block_size == block_size and is_attributable(req)
               and not cached_unknown(req))
    if is_attributable(req):
        if offsets is None:
            pred = None  # without segment counts, no predecessor rule can be checked
        if cached_unknown(req):
            skipped = (SKIP_READING_PREFIX_CACHE if req.get("skip_reading_prefix_cache")
                       else SEVERAL_ENGINE_REQUESTS if (req.get("engine_requests") or 1) > 1 else "")
            split = [(NOT_REPORTED, skipped, _int(req, "prompt_tokens"))]
        else:
            reuse = _reuse_cause(req, pred) if pred is not None else (EVICTED, "")
            shared = shared_prefix(req, pred) if pred is not None else None
            if precise:
                assert evidence is not None
                previous_turn = pred is not None and pred.kind == PREVIOUS_TURN and not pred.beyond_horizon
                zones = drift_first(kv_evidence_zones(_int(req, "cached_tokens"), block_size, evidence,
                                                      previous_turn, pods_down(req)),
                                    shared, _int(req, "prompt_tokens"), block_size)
                reuse = _precise_reuse_cause(reuse, req, pred, evidence) if pred is not None else reuse
            split = split_missed_tokens(
                prompt_tokens=_int(req, "prompt_tokens"), cached_tokens=_int(req, "cached_tokens"),
                block_size=block_size, stable_prefix_tokens=offsets[HISTORY + 1] if offsets else None,
                shared=shared, reuse_cause=reuse, evidence_zones=zones,
            )
    pred_id = pred_pod = kind = ""
    gap_ms: float | None = None
    if pred is not None:
        prev = pred.request
        pred_id, pred_pod, kind = _str(prev, "request_id"), _str(prev, "pod"), pred.stored_kind
        gap_ms = float(_ts_ms(req) - _ts_ms(prev)) - float(prev.get("e2e_ms") or 0.0)
    return Verdict(
        _str(req, "request_id"), req["ts"], _str(req, "tenant_id"), _str(req, "pod"), _str(req, "model"),
        _int(req, "prompt_tokens"), None if cached_unknown(req) else _int(req, "cached_tokens"), pred_id, pred_pod,
        kind, gap_ms, block_size,
        tuple(c for c, _, _ in split), tuple(sc for _, sc, _ in split), tuple(n for _, _, n in split),
        *_evidence_fields(evidence if precise else None, split, bool(zones)))


def attribute_request(req: Request, pred: Predecessor | None, block_size: int) -> list[MissRow]:
    """The miss_attribution rows of one request (empty when it failed or missed nothing), in prompt order:
    :func:`judge`'s verdict as rows."""
    return judge(req, pred, block_size).rows()


def block_size_for(req: Request, block_size_by_pod: Mapping[str, int], default_block_size: int) -> int:
    """Tokens per block of the request's pod: its ``vllm:cache_config_info`` value, else the default."""
    size = int(block_size_by_pod.get(_str(req, "pod")) or 0)
    return size if size > 0 else default_block_size


def attribute(requests: Iterable[Request], window: Iterable[Request] = (), *,
              block_size_by_pod: Mapping[str, int] | None = None,
              default_block_size: int = DEFAULT_BLOCK_SIZE,
              horizon_seconds: float = DEFAULT_HORIZON_SECONDS,
              lookback_seconds: float = DEFAULT_LOOKBACK_SECONDS,
              kv_evidence: Mapping[str, KvEvidence] | None = None) -> list[MissRow]:
    """Attribute the missed tokens of ``requests``; rows ordered by (ts, request_id), then prompt order.

    ``window``: further requests that may be predecessors (``requests`` are candidates too).
    ``block_size_by_pod``: tokens per block from each pod's ``vllm:cache_config_info``; a pod not in it (or
    with a non-positive value) uses ``default_block_size`` (vLLM's default, 16).
    ``horizon_seconds``: the furthest back a predecessor may lie; ``lookback_seconds``: the furthest back a
    request without one looks for a predecessor beyond the horizon (:class:`PredecessorIndex`).
    ``kv_evidence``: request_id → precise mode's :class:`KvEvidence` (see :func:`judge`); others by fingerprints.
    """
    # one per identity (request_id, ts), as the store keeps them: a row given twice is one request
    targets = sorted({(_str(r, "request_id"), _ts_ms(r)): r for r in requests}.values(), key=order_key)
    index = PredecessorIndex([*window, *targets], horizon_seconds, lookback_seconds)
    sizes = block_size_by_pod or {}
    rows: list[MissRow] = []
    for req in targets:
        if is_attributable(req):
            evidence = (kv_evidence or {}).get(_str(req, "request_id"))
            rows.extend(judge(req, index.find(req), block_size_for(req, sizes, default_block_size), evidence).rows())
    return rows
