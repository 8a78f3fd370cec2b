"""Demo workload: seeded multi-tenant chat traffic, sent to the gateway, each request labeled with the
prefix-cache pathology it was built to show (the ground truth for miss-cause attribution).

Tenants (all with a long, stable system prompt, ~340 words ≈ 800 tokens = 25 blocks of 32):
  acme      chat, 3 turns, full history                   -> `none` (healthy baseline)
  globex    chat, 2 turns, timestamp + uuid line on top   -> `volatile_system`
  initech   agent runs of 3-4 calls, tool waits between,
            tool schemas with keys shuffled per call      -> `tools_reordered`
  umbrella  RAG chat, 2 turns, same documents reordered   -> `rag_reordered`
  hooli     chat, 4 turns, history cut to the last 2
            messages from turn 3 on                       -> `history_truncated` (turns >= 3), else `none`
  stark     chat, 2 turns, a "Trace: <12 hex>" line in the
            middle of the system prompt (a form no regex
            mask knows)                                   -> `volatile_system` (scenario volatile_unknown_form)
  wayne     one-turn RAG questions, the documents pasted
            into the user message, rotated per session    -> `rag_reordered` (scenario rag_in_user_message)
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import random
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

PATHOLOGIES = ("none", "volatile_system", "tools_reordered", "rag_reordered", "history_truncated")


@dataclass(frozen=True)
class TenantSpec:
    """A tenant's traffic shape: `sessions` conversations/agent runs at scale 1.0, `turns` (min, max)."""

    name: str
    kind: str  # "chat" | "agent" | "rag"
    pathology: str
    sessions: int
    turns: tuple[int, int]
    scenario: str = ""  # the labels' scenario; "" = the pathology


TENANTS = (
    TenantSpec("acme", "chat", "none", 5, (3, 3)),
    TenantSpec("globex", "chat", "volatile_system", 4, (2, 2)),
    TenantSpec("initech", "agent", "tools_reordered", 4, (3, 4)),
    TenantSpec("umbrella", "rag", "rag_reordered", 5, (2, 2)),
    TenantSpec("hooli", "chat", "history_truncated", 4, (4, 4)),
    TenantSpec("stark", "chat", "volatile_system", 3, (2, 2), "volatile_unknown_form"),
    TenantSpec("wayne", "rag_inline", "rag_reordered", 4, (1, 1), "rag_in_user_message"),
)
TRUNCATE_FROM_TURN = 3  # hooli keeps only the last TRUNCATE_KEEP_MESSAGES history messages from here on
TRUNCATE_KEEP_MESSAGES = 2

WORDS = """
account access action address agent alert amount answer approval archive audit balance batch billing
branch budget cache calendar campaign carrier case catalog change channel charge check claim client
column comment company compliance contract copy cost credit customer dashboard data date deadline
delivery deposit detail device discount dispute document draft due email entry error estimate event
exchange expense export feature fee field file filter finance forecast form fraud fund group guide
history hold import incident index inquiry insurance inventory invoice issue item journal key label
language ledger level limit line list loan location log margin market member message method metric
model month note notice offer office order owner package page partner payment payroll period plan
policy portal price priority process product profile project quote rate reason receipt record refund
region release report request reserve response result return review risk role route rule sale
schedule schema score search segment service session setting shipment signal source status step
stock store subscription summary supplier support survey table task tax team template term ticket
tier token total trade transfer trend update usage user value vendor version volume warehouse week
""".split()
FILLER = "the a of to and for with on in by from that this each all any when before after within".split()

AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_orders",
            "description": "Find a customer's orders by status and date range.",
            "parameters": {
                "type": "object",
                "properties": {
                    "customer": {
                        "type": "object",
                        "properties": {"id": {"type": "string"}, "region": {"type": "string"}},
                        "required": ["id"],
                    },
                    "filters": {
                        "type": "object",
                        "properties": {
                            "status": {"type": "string", "enum": ["open", "shipped", "returned"]},
                            "date_range": {
                                "type": "object",
                                "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                            },
                        },
                    },
                    "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                },
                "required": ["customer"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_invoice",
            "description": "Fetch one invoice with its line items.",
            "parameters": {
                "type": "object",
                "properties": {
                    "invoice_id": {"type": "string"},
                    "include": {
                        "type": "object",
                        "properties": {"lines": {"type": "boolean"}, "payments": {"type": "boolean"}},
                    },
                },
                "required": ["invoice_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_ticket",
            "description": "Open a support ticket for a human agent.",
            "parameters": {
                "type": "object",
                "properties": {
                    "subject": {"type": "string"},
                    "priority": {"type": "string", "enum": ["low", "normal", "high"]},
                    "contact": {
                        "type": "object",
                        "properties": {"email": {"type": "string"}, "phone": {"type": "string"}},
                    },
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["subject", "priority"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "issue_refund",
            "description": "Refund part or all of a payment.",
            "parameters": {
                "type": "object",
                "properties": {
                    "payment_id": {"type": "string"},
                    "amount": {
                        "type": "object",
                        "properties": {"value": {"type": "number"}, "currency": {"type": "string"}},
                        "required": ["value", "currency"],
                    },
                    "reason": {"type": "string"},
                },
                "required": ["payment_id", "amount"],
            },
        },
    },
]


def _text(rng: random.Random, n_words: int) -> str:
    """`n_words` of pseudo-English from the fixed word lists, in sentences."""
    out, sentence = [], []
    for _ in range(n_words):
        sentence.append(rng.choice(WORDS) if rng.random() < 0.7 else rng.choice(FILLER))
        if len(sentence) >= rng.randint(8, 16):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


@cache
def system_prompt(seed: int, tenant: str) -> str:
    """The tenant's stable system prompt (~340 words, ~800 tiny-model tokens); same for every request."""
    rng = random.Random(f"{seed}:{tenant}:system")
    paragraphs = [f"You are the support assistant of {tenant.capitalize()}. Follow the policy below."]
    paragraphs += [f"Policy {i + 1}. " + _text(rng, 64) for i in range(5)]
    return "\n\n".join(paragraphs)


@cache
def rag_documents(seed: int, tenant: str) -> tuple[tuple[str, str], ...]:
    """The tenant's retrieval pack: 5 (title, text) documents of ~50 words, in canonical order."""
    rng = random.Random(f"{seed}:{tenant}:documents")
    return tuple((f"{rng.choice(WORDS).capitalize()} guide {i + 1}", _text(rng, 50)) for i in range(5))


def volatile_header(now: datetime, request_uuid: str) -> str:
    """globex's first system-prompt line: a millisecond timestamp and a request uuid."""
    stamp = now.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"Current time: {stamp} request {request_uuid}"


def shuffle_keys(value: Any, rng: random.Random) -> Any:
    """A copy of `value` with every dict's keys in a random order (list order is kept: it has meaning)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: shuffle_keys(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [shuffle_keys(v, rng) for v in value]
    return value


def reordered_tools(rng: random.Random, previous: list[dict] | None) -> list[dict]:
    """AGENT_TOOLS with the keys inside each `parameters` shuffled, never equal to `previous` as sent.

    Only `parameters` is shuffled: vLLM re-serializes the outer `{"type","function":{"name",...}}` levels
    through its pydantic models (`tool.model_dump()` in vllm/renderers/online_renderer.py), so a reorder
    there never reaches the prompt, while `parameters` is passed through in the client's key order.
    """
    for _ in range(20):
        tools = copy.deepcopy(AGENT_TOOLS)
        for tool in tools:
            tool["function"]["parameters"] = shuffle_keys(tool["function"]["parameters"], rng)
        if previous is None or json.dumps(tools) != json.dumps(previous):
            return tools
    raise AssertionError("could not draw a different key order")  # 20 collisions: practically impossible


@dataclass
class Turn:
    """What one request of a session will carry, drawn up front so labels do not depend on timing."""

    user_text: str
    max_tokens: int
    wait_before_seconds: float  # think time (chat) or tool latency (agent) before this request
    tools: list[dict] | None = None
    doc_order: list[int] | None = None
    tool_call: dict | None = None  # agent: the call "made" after this turn's reply, and its result


@dataclass
class Session:
    """One conversation or agent run: its ids, its planned turns and the history built so far."""

    tenant: TenantSpec
    index: int
    seed: int
    model: str = "tiny"
    id_prefix: str = ""
    turns: list[Turn] = field(init=False, default_factory=list)
    history: list[dict] = field(init=False, default_factory=list)  # messages after the system prompt
    request_uuids: list[str] = field(init=False, default_factory=list)  # globex's volatile header

    def __post_init__(self) -> None:
        rng = random.Random(f"{self.seed}:{self.tenant.name}:{self.index}")
        n_turns = rng.randint(*self.tenant.turns)
        tools = None
        for k in range(n_turns):
            turn = Turn(
                user_text=_text(rng, rng.randint(15, 40)) + " What should I do?",
                max_tokens=rng.randint(8, 16),
                wait_before_seconds=rng.uniform(0.2, 1.0) if self.is_agent else rng.uniform(0.0, 0.4),
            )
            if self.is_agent:
                tools = turn.tools = reordered_tools(rng, tools)
                name = rng.choice(AGENT_TOOLS)["function"]["name"]
                turn.tool_call = {
                    "id": f"call-{self.conversation_id}-{k + 1}",
                    "name": name,
                    "arguments": json.dumps({"query": _text(rng, 4)}),
                    "result": json.dumps({"status": "ok", "summary": _text(rng, rng.randint(20, 60))}),
                }
            if self.tenant.kind == "rag":
                turn.doc_order = self._doc_order(rng, self.turns[-1].doc_order if self.turns else None)
            elif self.tenant.kind == "rag_inline":  # rotated by the session: two sessions differ in order
                n_docs = len(rag_documents(self.seed, self.tenant.name))
                turn.doc_order = [(self.index + i) % n_docs for i in range(n_docs)]
            self.turns.append(turn)
        self.request_uuids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n_turns)]

    @property
    def is_agent(self) -> bool:
        return self.tenant.kind == "agent"

    @property
    def conversation_id(self) -> str:
        letter = "r" if self.is_agent else "c"
        return f"{self.id_prefix}{self.tenant.name}-{letter}{self.index}"

    @property
    def agent_run_id(self) -> str | None:
        return self.conversation_id if self.is_agent else None

    def request_id(self, turn: int) -> str:
        """`<tenant>-c<index>-t<turn>` (agents: `-r<index>`), turns counted from 1."""
        return f"{self.conversation_id}-t{turn}"

    def _doc_order(self, rng: random.Random, previous: list[int] | None) -> list[int]:
        order = list(range(len(rag_documents(self.seed, self.tenant.name))))
        while True:
            rng.shuffle(order)
            if order != previous:
                return list(order)

    def label(self, turn: int) -> dict[str, Any]:
        """The ground-truth record of request `turn` (1-based): ids, turn, intended pathology and the scenario
        (the tenant's pathology: hooli's first turns are `none` within scenario `history_truncated`).
        kvscope maps pathologies to miss causes (ingest/labels.py PATHOLOGY_CAUSES)."""
        pathology = self.tenant.pathology
        if pathology == "history_truncated" and turn < TRUNCATE_FROM_TURN:
            pathology = "none"
        plan = self.turns[turn - 1]
        return {
            "request_id": self.request_id(turn),
            "tenant_id": self.tenant.name,
            "conversation_id": self.conversation_id,
            "agent_run_id": self.agent_run_id,
            "turn": turn,
            "pathology": pathology,
            "scenario": self.tenant.scenario or self.tenant.pathology,
            # tool latency before this call (agents, calls >= 2); run_workload scales it by wait_scale
            "tool_wait_ms": round(plan.wait_before_seconds * 1000) if self.is_agent and turn > 1 else None,
        }

    def system_prompt(self, turn: int, now: datetime) -> str:
        base = system_prompt(self.seed, self.tenant.name)
        if self.tenant.scenario == "volatile_unknown_form":  # a line in the middle, a form the masks miss
            paragraphs = base.split("\n\n")
            paragraphs[3] = f"Trace: {uuid.UUID(self.request_uuids[turn - 1]).hex[:12]}\n{paragraphs[3]}"
            return "\n\n".join(paragraphs)
        if self.tenant.pathology == "volatile_system":
            return volatile_header(now, self.request_uuids[turn - 1]) + "\n" + base
        return base

    def request(self, turn: int, now: datetime) -> tuple[dict[str, str], dict[str, Any]]:
        """(headers, JSON body) of request `turn` (1-based), given the history recorded so far."""
        plan = self.turns[turn - 1]
        history = self.history
        if self.tenant.pathology == "history_truncated" and turn >= TRUNCATE_FROM_TURN:
            history = history[-TRUNCATE_KEEP_MESSAGES:]
        messages = [{"role": "system", "content": self.system_prompt(turn, now)}, *history]
        if not self.is_agent or turn == 1:  # an agent's later calls continue from the tool result
            messages.append({"role": "user", "content": self.user_text(turn)})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": plan.max_tokens}
        if plan.tools is not None:
            body["tools"] = plan.tools
            body["tool_choice"] = "none"  # "auto" needs --enable-auto-tool-choice and a parser
        if plan.doc_order is not None and self.tenant.kind == "rag":
            docs = rag_documents(self.seed, self.tenant.name)
            body["documents"] = [{"title": docs[i][0], "text": docs[i][1]} for i in plan.doc_order]
        headers = {
            "X-Tenant-Id": self.tenant.name,
            "X-Conversation-Id": self.conversation_id,
            "X-Request-Id": self.request_id(turn),
        }
        if self.agent_run_id:
            headers["X-Agent-Run-Id"] = self.agent_run_id
        return headers, body

    def user_text(self, turn: int) -> str:
        """The user message of request `turn`: the planned question, after the documents (title and text as
        paragraphs, in the turn's order) for a tenant that pastes them into the message."""
        plan = self.turns[turn - 1]
        if self.tenant.kind != "rag_inline" or plan.doc_order is None:
            return plan.user_text
        docs = rag_documents(self.seed, self.tenant.name)
        return "\n\n".join([*(f"{docs[i][0]}\n\n{docs[i][1]}" for i in plan.doc_order), plan.user_text])

    def record_reply(self, turn: int, reply: str) -> None:
        """Append turn `turn`'s exchange to the history (agents: plus the tool call and its result)."""
        plan = self.turns[turn - 1]
        if not self.is_agent or turn == 1:
            self.history.append({"role": "user", "content": self.user_text(turn)})
        assistant: dict[str, Any] = {"role": "assistant", "content": reply}
        if plan.tool_call:
            call = plan.tool_call
            assistant["tool_calls"] = [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}
            ]  # fmt: skip
        self.history.append(assistant)
        if plan.tool_call:
            call = plan.tool_call
            self.history.append({"role": "tool", "tool_call_id": call["id"], "content": call["result"]})


def _session_count(spec: TenantSpec, scale: float) -> int:
    return max(1, round(spec.sessions * scale))


def iter_sessions(seed: int = 0, scale: float = 1.0, *, loop: bool = False, model: str = "tiny",
                  id_prefix: str = "") -> Iterator[Session]:  # fmt: skip
    """Sessions of all tenants, interleaved in a seeded order; with `loop`, new rounds forever."""
    round_no = 0
    while True:
        sessions = [
            Session(spec, round_no * _session_count(spec, scale) + i, seed, model, id_prefix)
            for spec in TENANTS
            for i in range(_session_count(spec, scale))
        ]
        random.Random(f"{seed}:order:{round_no}").shuffle(sessions)
        yield from sessions
        if not loop:
            return
        round_no += 1


def plan_labels(seed: int = 0, scale: float = 1.0) -> list[dict[str, Any]]:
    """The labels `run_workload(seed=seed, scale=scale)` produces, without sending anything."""
    return [s.label(t) for s in iter_sessions(seed, scale) for t in range(1, len(s.turns) + 1)]


def run_workload(
    gateway_url: str,
    *,
    seed: int = 0,
    scale: float = 1.0,
    concurrency: int = 2,
    labels_path: Path | None = None,
    stop_event: threading.Event | None = None,
    loop: bool = False,
    model: str = "tiny",
    id_prefix: str = "",
    wait_scale: float = 1.0,
    timeout_seconds: float = 120.0,
    transport: httpx.BaseTransport | None = None,
    run_id: str = "",
) -> list[dict[str, Any]]:
    """Send the workload to `gateway_url` (`POST {gateway_url}/v1/chat/completions`); return its labels.

    `scale` multiplies sessions per tenant (1.0 ≈ 63 requests). `concurrency` sessions run at once (one
    thread each); a session's turns are sequential, separated by think/tool waits (× `wait_scale`), so
    sessions interleave and a round-robin gateway sends some later turns to another pod. `loop` keeps
    starting new sessions until `stop_event` is set. Each label (see `Session.label`) gains `ts` (when it was
    sent, ISO 8601 UTC with ms), `run_id` and the outcome fields of `_send` (`status`, `http_status`,
    `prompt_tokens`, `cached_tokens`); labels are appended to
    `labels_path` (JSON lines) as requests finish and returned in plan order. HTTP failures are recorded,
    never raised.
    """
    stop_event = stop_event or threading.Event()
    sessions = iter_sessions(seed, scale, loop=loop, model=model, id_prefix=id_prefix)
    lock = threading.Lock()
    results: list[tuple[int, int, dict[str, Any]]] = []
    order = itertools.count()
    sink = open(labels_path, "w") if labels_path else None  # noqa: SIM115 (closed below)

    def next_session() -> tuple[int, Session] | None:
        with lock:
            if stop_event.is_set():
                return None
            session = next(sessions, None)
            return None if session is None else (next(order), session)

    def record(position: int, turn: int, label: dict[str, Any]) -> None:
        with lock:
            results.append((position, turn, label))
            if sink:
                sink.write(json.dumps(label) + "\n")
                sink.flush()

    def worker(client: httpx.Client) -> None:
        while (item := next_session()) is not None:
            position, session = item
            for turn in range(1, len(session.turns) + 1):
                wait = session.turns[turn - 1].wait_before_seconds * wait_scale
                if turn > 1 and stop_event.wait(wait):
                    break
                label = session.label(turn)
                if label["tool_wait_ms"] is not None:
                    label["tool_wait_ms"] = round(label["tool_wait_ms"] * wait_scale)  # what was waited
                now = _now()
                label["ts"] = now.isoformat(timespec="milliseconds").replace("+00:00", "Z")
                label["run_id"] = run_id
                reply, outcome = _send(client, gateway_url, *session.request(turn, now))
                label.update(outcome)
                session.record_reply(turn, reply if reply is not None else "")
                record(position, turn, label)

    try:
        with httpx.Client(timeout=timeout_seconds, transport=transport) as client:
            threads = [threading.Thread(target=worker, args=(client,), daemon=True)
                       for _ in range(concurrency)]  # fmt: skip
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        if sink:
            sink.close()
    return [label for _, _, label in sorted(results, key=lambda r: (r[0], r[1]))]


def _now() -> datetime:
    return datetime.now(UTC)


def _send(client: httpx.Client, gateway_url: str, headers: dict[str, str],
          body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:  # fmt: skip
    """POST one chat completion; return (assistant text or None on failure, outcome fields for the label).

    Outcome: `status` ("ok" | "error"), `http_status`, `prompt_tokens`, `cached_tokens` (None when the
    response has no `usage.prompt_tokens_details`).
    """
    outcome: dict[str, Any] = {"status": "error", "http_status": None}
    outcome.update(prompt_tokens=None, cached_tokens=None)
    url = gateway_url.rstrip("/") + "/v1/chat/completions"
    try:
        response = client.post(url, headers=headers, json=body)
    except httpx.HTTPError as exc:
        log.warning("workload request failed request_id=%s error=%r", headers["X-Request-Id"], exc)
        return None, outcome
    outcome["http_status"] = response.status_code
    if response.status_code != 200:
        log.warning("workload request rejected request_id=%s status=%s body=%s",
                    headers["X-Request-Id"], response.status_code, response.text[:300])  # fmt: skip
        return None, outcome
    try:
        data = response.json()
        reply = data["choices"][0]["message"].get("content") or ""
    except (ValueError, KeyError, IndexError, TypeError):
        return None, outcome
    usage = data.get("usage") or {}
    outcome.update(
        status="ok",
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    )
    return reply, outcome
