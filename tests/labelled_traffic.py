"""The labelled run's traffic (tests/test_labelled_run.py): every miss cause built on purpose, sent through the
reference gateway to a chosen pod, each request with the cause it was built to show (its label).

Pods: pod-0 is the *evicting* pod (floods of unrelated long prompts go there); pod-1 sees little traffic and
must evict nothing (the negative control). Phases, in time order:

0. beyond_horizon firsts on pod-0 (cold); pod-1 controls and below_block prompts; routed_away pairs.
A. On pod-0: eviction victims, chats whose second turn comes after the flood, an agent run's first two calls
   (a short tool wait: the prefix stays warm, label none).
B. The flood on pod-0: unrelated ~800-token prompts, more blocks than the pod holds, so every block stored on
   pod-0 before it is evicted (vLLM's LRU free queue, vllm/v1/core/block_pool.py).
C. Victims repeated on pod-0 (evicted), the chats' second turns and the agent's third call (the long tool wait
   spanned the flood: evicted_before_next_turn).
D. The demo workload's drift tenants (demo/workload.py Session: volatile header, a volatile line mid system
   prompt, reordered tool schemas, RAG documents reordered, history truncated), documents inside the user message
   reordered and with one replaced, a system prompt changed and a tool changed between two turns; every turn on
   pod-0, back to back.
R. On pod-0, idle: a chat's first turn, vLLM's ``POST /reset_prefix_cache`` (an ``AllBlocksCleared``), its second
   turn (evicted/cache_reset: only KV events can tell a reset from memory pressure). Then, twice from a cache reset
   again, tail eviction: a long prompt, one unrelated filler sized to take the free blocks and exactly the long
   prompt's last blocks (vLLM frees a request's blocks last block first, so its tail is evicted first), and the
   long prompt again: a partial hit that stops at a block, the rest evicted; once half its blocks, once only the
   last hittable one.
E. After a pause longer than the horizon chosen for attribution, beyond_horizon repeats on pod-1 (which never held
   them; the flood evicted them from pod-0): nothing holds the prefix, only its age names the cause.

Expected token splits (label ``expected_tokens``) are derived by hand from vLLM's reply only where the scenario
fixes them: B = 32 tokens per block, P prompt tokens, C cached, L = ⌊(P − 1)/B⌋·B the most vLLM can hit
(vllm/v1/core/kv_cache_manager.py: the last prompt token is always computed).
- an identical prompt repeated where its blocks are gone (evicted, routed_away, beyond_horizon), C = 0:
  L tokens of that cause, P − L unavoidable;
- an identical prompt repeated on the pod that holds it (control), C = L: P − L unavoidable;
- a prompt of at most one block (P − 1 < B): P − 1 below_block, 1 unavoidable;
- an identical prompt repeated on its pod after its tail was evicted, 0 < C < L (a partial hit): L − C evicted,
  P − L unavoidable.
Where vLLM's reply contradicts the scenario (a repeat that hit when it should not), the mismatch is recorded in
``Traffic.broken`` and the test reports it as a broken scenario, not as an attribution error.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from demo.workload import AGENT_TOOLS, TENANTS, Session, TenantSpec, _text, rag_documents, system_prompt
from ingest.labels import PATHOLOGY_CAUSES

BLOCK = 32  # tokens per KV block (demo.fleet.VllmFleet default; the CPU backend wants a multiple of 32)
MAX_TOKENS = 8
FLOOD_PROMPTS = 8  # x ~27 blocks = ~216 block allocations > the 159 usable blocks of a pod (see the test)
SEED = 9
SHORT_WAIT_SECONDS = 0.5  # the agent's short tool wait
LONG_WAIT_SECONDS = 5.0  # the agent's long tool wait (the flood runs within it)
NUM_BLOCKS = 160  # KV blocks per pod (the fleet's num_gpu_blocks_override): 159 usable, vLLM keeps a null block
TAIL_BLOCKS = 80  # full blocks of the tail-eviction prompt
TAIL_EVICTED = 40  # of them, the filler is sized to evict exactly this many hittable ones (its tail)


def hittable(prompt_tokens: int) -> int:
    """L = ⌊(P − 1)/B⌋·B: the most prompt tokens vLLM can serve from its prefix cache."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def short_system(tenant: str) -> str:
    """A ~170-token system prompt unique to ``tenant`` (the demo's first two paragraphs: ~6 blocks)."""
    return "\n\n".join(system_prompt(SEED, tenant).split("\n\n")[:2])


def long_system(tenant: str) -> str:
    """The demo's ~800-token system prompt for ``tenant`` (~25 blocks)."""
    return system_prompt(SEED, tenant)


@dataclass
class Sent:
    """One request as sent and answered: the label fields, where it went, what vLLM reported."""

    request_id: str
    pod: str
    tenant: str
    scenario: str
    cause: str
    sub_cause: str
    ts: datetime
    predecessor: str | None  # the request this one was built to reuse (None: none)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    expected: list[dict[str, Any]] | None = None

    def label(self, run_id: str) -> dict[str, Any]:
        """The label line (ingest/labels.py) of this request."""
        out: dict[str, Any] = {"request_id": self.request_id, "tenant_id": self.tenant, "run_id": run_id,
                               "scenario": self.scenario, "cause": self.cause, "sub_cause": self.sub_cause,
                               "ts": self.ts.isoformat(timespec="milliseconds").replace("+00:00", "Z")}
        if self.expected is not None:
            out["expected_tokens"] = self.expected
        return out


@dataclass
class Traffic:
    """Sends chat completions to ``gateways`` (pod name → URL of a gateway that routes to that pod only) and
    records each request (:class:`Sent`). ``broken``: scenario preconditions vLLM's replies contradicted."""

    gateways: dict[str, str]
    client: httpx.Client
    servers: dict[str, str] = field(default_factory=dict)  # pod name → vLLM base URL (dev routes)
    sent: list[Sent] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)

    def send(self, pod: str, request_id: str, tenant: str, body: dict[str, Any], *, cause: str, sub_cause: str = "",
             scenario: str = "", predecessor: str | None = None, expect: str = "",
             headers: dict[str, str] | None = None) -> tuple[Sent, str]:
        """POST ``body`` through pod's gateway; returns (the record, the reply text). ``expect``: "reuse",
        "hit", "tail" or "below_block" to derive the expected split (module docstring). Raises AssertionError when the
        request fails (the run cannot be judged without it)."""
        hdrs = {"X-Request-Id": request_id, "X-Tenant-Id": tenant, **(headers or {})}
        body = {"model": "tiny", "max_tokens": MAX_TOKENS, **body}
        rec = Sent(request_id, pod, tenant, scenario or cause, cause, sub_cause, datetime.now(UTC), predecessor)
        resp = self.client.post(self.gateways[pod] + "/v1/chat/completions", headers=hdrs, json=body)
        assert resp.status_code == 200, (request_id, resp.status_code, resp.text[:300])
        data = resp.json()
        usage = data["usage"]
        rec.prompt_tokens = usage["prompt_tokens"]
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rec.completion_tokens = usage.get("completion_tokens") or 0
        if expect:
            rec.expected = self._expected(rec, expect)
        self.sent.append(rec)
        return rec, data["choices"][0]["message"].get("content") or ""

    def _expected(self, rec: Sent, expect: str) -> list[dict[str, Any]] | None:
        p, c, lim = rec.prompt_tokens, rec.cached_tokens, hittable(rec.prompt_tokens)
        if expect == "reuse" and c == 0:
            return [{"cause": rec.cause, "sub_cause": rec.sub_cause, "tokens": lim},
                    {"cause": "unavoidable", "tokens": p - lim}]
        if expect == "hit" and c == lim:
            return [{"cause": "unavoidable", "tokens": p - lim}]
        if expect == "tail" and 0 < c < lim:
            return [{"cause": rec.cause, "sub_cause": rec.sub_cause, "tokens": lim - c},
                    {"cause": "unavoidable", "tokens": p - lim}]
        if expect == "below_block" and lim == 0:
            return [{"cause": "below_block", "tokens": p - 1}, {"cause": "unavoidable", "tokens": 1}]
        self.broken.append(f"{rec.request_id} ({expect}): prompt {p}, cached {c}, hittable {lim}")
        return None

    def chat(self, pod: str, rid: str, tenant: str, system: str, user: str, **kw: Any) -> tuple[Sent, str]:
        """A one-turn chat: ``system`` then ``user``."""
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        return self.send(pod, rid, tenant, body, **kw)

    def reset_prefix_cache(self, pod: str) -> None:
        """vLLM's ``POST /reset_prefix_cache`` on ``pod`` (a dev route: VLLM_SERVER_DEV_MODE=1): every cached block
        is dropped and an ``AllBlocksCleared`` KV event published. Raises AssertionError when vLLM refuses (it
        does while a request holds blocks)."""
        for _ in range(20):  # a request that just answered may still hold its blocks for an engine step
            resp = self.client.post(self.servers[pod] + "/reset_prefix_cache")
            assert resp.status_code == 200, (pod, resp.status_code, resp.text[:300])
            if resp.json().get("success") is True:
                return
            time.sleep(0.25)
        raise AssertionError(f"{pod} refused /reset_prefix_cache 20 times: {resp.text[:300]}")

    def tokens(self, pod: str, messages: list[dict[str, Any]]) -> int:
        """Prompt tokens of ``messages`` as ``pod`` renders them (vLLM's ``POST /tokenize``)."""
        resp = self.client.post(self.servers[pod] + "/tokenize", json={"model": "tiny", "messages": messages})
        assert resp.status_code == 200, (pod, resp.status_code, resp.text[:300])
        return int(resp.json()["count"])

    def write_labels(self, path: Path, run_id: str) -> None:
        """Every request's label as JSON lines (ingest/labels.py format)."""
        path.write_text("".join(json.dumps(s.label(run_id)) + "\n" for s in self.sent))


def two_turns(t: Traffic, pods: tuple[str, str], rid: str, tenant: str, *, cause: str, sub_cause: str = "",
              send_second: bool = True) -> Any:
    """A two-turn chat, turn 1 on pods[0] (cold), turn 2 on pods[1]; returns a function sending turn 2 when
    ``send_second`` is False (to send it later)."""
    system = short_system(tenant)
    hdr = {"X-Conversation-Id": rid}
    first, reply = t.chat(pods[0], f"{rid}-t1", tenant, system, "First question: what is due?", cause="cold",
                          scenario=cause, headers=hdr)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "First question: what is due?"},
                {"role": "assistant", "content": reply}, {"role": "user", "content": "And after that?"}]

    def second() -> Sent:
        return t.send(pods[1], f"{rid}-t2", tenant, {"messages": messages}, cause=cause, sub_cause=sub_cause,
                      predecessor=first.request_id, headers=hdr)[0]
    if send_second:
        return second()
    return second


def repeat_pair(t: Traffic, pods: tuple[str, str], rid: str, tenant: str, *, cause: str, system: str = "",
                sub_cause: str = "", expect: str = "reuse", send_second: bool = True) -> Any:
    """One prompt sent on pods[0] (cold), then the identical prompt on pods[1] (``cause``), now or later."""
    system = system or short_system(tenant)
    first, _ = t.chat(pods[0], f"{rid}-a", tenant, system, "Summarize the policy.", cause="cold", scenario=cause)

    def second() -> Sent:
        return t.chat(pods[1], f"{rid}-b", tenant, system, "Summarize the policy.", cause=cause,
                      sub_cause=sub_cause, predecessor=first.request_id, expect=expect)[0]
    if send_second:
        return second()
    return second


def agent_session(tenant: str) -> Session:
    """The demo's agent run, with its tool schemas kept in one order (the demo reshuffles them per call to show
    tools_reordered; here the run must only be cold, warm, then evicted)."""
    session = Session(TenantSpec(tenant, "agent", "none", 1, (3, 3)), 0, SEED, id_prefix="lab-")
    for turn in session.turns:
        turn.tools = copy.deepcopy(AGENT_TOOLS)
    return session


def session_turn(t: Traffic, session: Session, turn: int, pod: str, cause: str, sub_cause: str = "",
                 scenario: str = "") -> Sent:
    """Send ``session``'s call ``turn`` (1-based) to ``pod`` with the given label, record the reply."""
    headers, body = session.request(turn, datetime.now(UTC))
    rid = headers.pop("X-Request-Id")
    tenant = headers.pop("X-Tenant-Id")
    pred = session.request_id(turn - 1) if turn > 1 else None
    rec, reply = t.send(pod, rid, tenant, body, cause=cause, sub_cause=sub_cause, predecessor=pred,
                        scenario=scenario or session.tenant.pathology, headers=headers)
    session.record_reply(turn, reply)
    return rec


def drift_sessions(t: Traffic, pod: str) -> None:
    """Phase D: the demo's drift tenants, each session's turns back to back on ``pod``; turn 1 is cold, later
    turns take the demo's label (ingest.labels.PATHOLOGY_CAUSES). Each session is its own tenant (the demo's name
    and the index), so a session's first request has no predecessor in another session."""
    specs = {s.name: s for s in TENANTS}
    plan = [("globex", 2), ("stark", 1), ("initech", 1), ("umbrella", 2), ("hooli", 1)]
    for name, count in plan:
        for index in range(count):
            spec = dataclasses.replace(specs[name], name=f"{name}{index}")
            session = Session(spec, index, SEED, id_prefix="lab-")
            for turn in range(1, len(session.turns) + 1):
                cause, sub = PATHOLOGY_CAUSES[session.label(turn)["pathology"]]
                if turn == 1:
                    cause, sub = "cold", ""
                session_turn(t, session, turn, pod, cause, sub, scenario=spec.scenario)


def documents_in_user_message(t: Traffic, pod: str) -> None:
    """Phase D: retrieved documents pasted into the user message (the suffix: no retrieval segment), one-turn
    questions of one tenant on ``pod``. The demo's wayne: a session's documents rotated against the previous
    session's (rag_reordered); then a tenant whose second question carries the same documents with the middle
    one replaced (rag_changed)."""
    spec = next(s for s in TENANTS if s.name == "wayne")
    for index in range(2):
        session = Session(spec, index, SEED, id_prefix="lab-")
        pred = Session(spec, index - 1, SEED, id_prefix="lab-").request_id(1) if index else None
        cause, sub = ("prefix_drift", "rag_reordered") if index else ("cold", "")
        headers, body = session.request(1, datetime.now(UTC))
        rid, tenant = headers.pop("X-Request-Id"), headers.pop("X-Tenant-Id")
        t.send(pod, rid, tenant, body, cause=cause, sub_cause=sub, predecessor=pred, scenario=spec.scenario,
               headers=headers)
    tenant = "ragch"
    docs = list(rag_documents(SEED, tenant))
    replaced = [*docs[:2], rag_documents(SEED, f"{tenant}-other")[2], *docs[3:]]
    first = None
    for i, (pack, question) in enumerate([(docs, "Which guide covers refunds?"),
                                          (replaced, "Which guide covers returns?")]):
        user = "\n\n".join([*(f"{title}\n\n{text}" for title, text in pack), question])
        rec, _ = t.chat(pod, f"ragch-{i}", tenant, long_system(tenant), user, scenario="rag_changed_in_user_message",
                        cause="prefix_drift" if i else "cold", sub_cause="rag_changed" if i else "",
                        predecessor=first)
        first = rec.request_id


def changed_between_turns(t: Traffic, pod: str) -> None:
    """Phase D: two-turn chats on ``pod`` whose second turn changes a segment for good: the system prompt's last
    four policies rewritten (system_changed: more lines than a volatile change), one tool's description
    rewritten (tools_changed)."""
    def chat(rid: str, systems: tuple[str, str], tools: tuple[list | None, list | None], sub: str) -> None:
        hdr = {"X-Conversation-Id": rid}
        question = [{"role": "user", "content": "First question: what is due?"}]
        body: dict[str, Any] = {"messages": [{"role": "system", "content": systems[0]}, *question]}
        if tools[0] is not None:
            body.update(tools=tools[0], tool_choice="none")
        first, reply = t.send(pod, f"{rid}-t1", rid, body, cause="cold", scenario=sub, headers=hdr)
        body = {"messages": [{"role": "system", "content": systems[1]}, *question,
                             {"role": "assistant", "content": reply}, {"role": "user", "content": "And after that?"}]}
        if tools[1] is not None:
            body.update(tools=tools[1], tool_choice="none")
        t.send(pod, f"{rid}-t2", rid, body, cause="prefix_drift", sub_cause=sub, predecessor=first.request_id,
               headers=hdr)

    old = long_system("sysch").split("\n\n")
    new = "\n\n".join(old[:2] + long_system("sysch-v2").split("\n\n")[2:])
    chat("sysch", ("\n\n".join(old), new), (None, None), "system_changed")
    tools = copy.deepcopy(AGENT_TOOLS)
    changed = copy.deepcopy(AGENT_TOOLS)
    changed[-1]["function"]["description"] = "Look a customer up by name, email or phone, newest first."
    chat("toolch", (short_system("toolch"),) * 2, (tools, changed), "tools_changed")


def cache_reset_and_tail(t: Traffic, pod: str) -> None:
    """Phase R (module docstring) on ``pod``, which must be idle: a reset between two turns, then tail eviction
    twice from an emptied cache: about half of a long prompt's blocks, then only its last hittable block."""
    later = two_turns(t, (pod, pod), "rst0", "rst0", cause="evicted", sub_cause="cache_reset", send_second=False)
    t.reset_prefix_cache(pod)
    later()
    tail_eviction(t, pod, "tail40", TAIL_EVICTED)
    tail_eviction(t, pod, "tail1", 1)


def tail_eviction(t: Traffic, pod: str, tenant: str, evict: int) -> None:
    """Reset ``pod``'s cache, send a long prompt (a), an unrelated filler that evicts exactly ``evict`` of a's
    hittable blocks, from its tail, then a again (b, labelled evicted, expected L − C evicted with C = L − evict·B;
    else ``Traffic.broken`` says so).

    Block accounting (vllm/v1/core/block_pool.py, single_type_kv_cache_manager.py): after the reset all
    NUM_BLOCKS − 1 usable blocks are free and hashless; a request computes KV for P + completion − 1 tokens
    (⌈that/B⌉ blocks, the full ones hashed, generated tokens included) and frees its full blocks to the back
    of the free queue last block first; allocation takes hashless blocks first, then the queue's front. So a
    filler of F = NUM_BLOCKS − 1 − s + k blocks (s: a's full blocks) evicts a's last k blocks; k = s − L/B +
    ``evict`` of them are hittable ones. Completions are fixed at MAX_TOKENS (vLLM's ignore_eos, min_tokens)."""
    fixed = {"ignore_eos": True, "min_tokens": MAX_TOKENS}
    t.reset_prefix_cache(pod)
    system = long_system(tenant)
    user = sized_text(t, pod, system, tenant, TAIL_BLOCKS * BLOCK + BLOCK // 2)
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **fixed}
    first, _ = t.send(pod, f"{tenant}-a", tenant, body, cause="cold", scenario="tail_evicted")
    blocks = NUM_BLOCKS - 1 - hittable(first.prompt_tokens) // BLOCK + evict  # F with k = s − L/B + evict
    filler_system = long_system(f"{tenant}-filler")
    target = blocks * BLOCK - MAX_TOKENS + 1 - BLOCK // 2  # the middle of the prompt lengths that take `blocks`
    filler = {"messages": [{"role": "system", "content": filler_system},
                           {"role": "user", "content": sized_text(t, pod, filler_system, f"{tenant}-filler", target)}],
              **fixed}
    rec, _ = t.send(pod, f"{tenant}-filler", f"{tenant}-filler", filler, cause="cold", scenario="tail_evicted")
    took = -(-(rec.prompt_tokens + rec.completion_tokens - 1) // BLOCK)
    again, _ = t.send(pod, f"{tenant}-b", tenant, body, cause="evicted", scenario="tail_evicted",
                      predecessor=first.request_id, expect="tail")
    if took != blocks or again.cached_tokens != hittable(again.prompt_tokens) - evict * BLOCK:
        t.broken.append(f"{again.request_id}: filler took {took} blocks (planned {blocks}), cached "
                        f"{again.cached_tokens} of {hittable(again.prompt_tokens)} (planned {evict} blocks short)")


def sized_text(t: Traffic, pod: str, system: str, key: str, prompt_tokens: int) -> str:
    """Demo words (seeded by ``key``) for a user message that makes ``system`` + it about ``prompt_tokens`` long
    as ``pod`` tokenizes the chat (a few rounds of vLLM's /tokenize; within a few tokens)."""
    def text(words: int) -> str:
        return _text(random.Random(f"{SEED}:{key}:user"), max(1, words))

    def count(words: int) -> int:
        return t.tokens(pod, [{"role": "system", "content": system}, {"role": "user", "content": text(words)}])
    base, words = count(1), 100
    for _ in range(4):
        got = count(words)
        if abs(got - prompt_tokens) <= 4:
            break
        words = max(1, words + round((prompt_tokens - got) * words / max(1, got - base)))
    return text(words)


def run_traffic(t: Traffic, pods: list[str]) -> float:
    """Send the whole labelled run (module docstring); returns the horizon (seconds) to attribute it with:
    longer than every built predecessor gap but the beyond_horizon ones, which are longer still."""
    p0, p1 = pods
    # phase 0
    # first on pod-0, before the flood evicts it there; repeated on pod-1, which never held it: at the repeat no pod
    # holds the prefix (else KV events would show routed_away or evicted), only its age names the cause
    bh = [repeat_pair(t, (p0, p1), f"bh{i}", f"bh{i}", cause="beyond_horizon", send_second=False) for i in range(2)]
    for i, (system, user) in enumerate([("", "Hi."), ("Be brief.", "Status?"), ("", "Thanks, bye.")]):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        t.send(p1, f"bb{i}", f"bb{i}", {"messages": messages}, cause="below_block", expect="below_block")
    for i in range(2):
        repeat_pair(t, (p1, p1), f"ctl{i}", f"ctl{i}", cause="none", expect="hit")
    repeat_pair(t, (p0, p0), "ctl2", "ctl2", cause="none", expect="hit")
    two_turns(t, (p1, p1), "ctlc0", "ctlc0", cause="none")
    for i in range(3):
        two_turns(t, (p1, p0), f"rac{i}", f"rac{i}", cause="routed_away")
    for i in range(2):
        repeat_pair(t, (p1, p0), f"rar{i}", f"rar{i}", cause="routed_away")
    repeat_pair(t, (p0, p1), "rar2", "rar2", cause="routed_away")
    # phase A
    victims = [repeat_pair(t, (p0, p0), f"ev{i}", f"ev{i}", cause="evicted", send_second=False) for i in range(3)]
    chats = [two_turns(t, (p0, p0), f"evc{i}", f"evc{i}", cause="evicted", sub_cause="evicted_before_next_turn",
                       send_second=False) for i in range(2)]
    agent = agent_session("agentco")
    session_turn(t, agent, 1, p0, "cold", scenario="agent_ttl")
    time.sleep(SHORT_WAIT_SECONDS)
    second = session_turn(t, agent, 2, p0, "none", scenario="agent_ttl")
    # phase B
    for i in range(FLOOD_PROMPTS):
        t.chat(p0, f"flood{i}", "flood", long_system(f"flood{i}"), f"Flood request {i}: list the steps.",
               cause="cold", scenario="flood")
    time.sleep(max(0.0, LONG_WAIT_SECONDS - (datetime.now(UTC) - second.ts).total_seconds()))
    # phase C
    for later in victims + chats:
        later()
    session_turn(t, agent, 3, p0, "evicted", "evicted_before_next_turn", scenario="agent_ttl")
    # phase D
    drift_sessions(t, p0)
    documents_in_user_message(t, p0)
    changed_between_turns(t, p0)
    # phase R
    cache_reset_and_tail(t, p0)
    # phase E: the horizon lies between the longest built gap and the beyond_horizon gap
    by_id = {s.request_id: s for s in t.sent}
    longest = max((s.ts - by_id[s.predecessor].ts).total_seconds() for s in t.sent if s.predecessor)
    horizon = longest + 15.0
    wait = (by_id["bh0-a"].ts - datetime.now(UTC)).total_seconds() + horizon + 15.0
    if wait > 0:
        time.sleep(wait)
    for later in bh:
        later()
    return horizon
