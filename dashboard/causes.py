"""The miss-cause vocabulary every view shares: one colour per cause, plain-words fixes, the adoption order.

The dashboard's charts, the overview's "fix first", the digest and the alerts all draw causes from here, so a
cause keeps its colour when filters change and reads the same in an email as on a page. Cause names are the
attribution's (``ingest/attribution.py``; defined in docs/miss-causes.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ingest import attribution as a

#: Causes in the order legends and tables list them: the actionable ones first, then what no fix removes.
CAUSE_ORDER: tuple[str, ...] = (
    a.PREFIX_DRIFT, a.ROUTED_AWAY, a.EVICTED, a.NOT_REPORTED, a.BEYOND_HORIZON, a.COLD, a.BELOW_BLOCK,
    a.UNAVOIDABLE, a.UNKNOWN,
)

#: One colour per cause (and per prefix_drift sub-cause, shades of the drift hue), used everywhere a cause is
#: drawn. Colour-blind-safe hues from the Okabe–Ito palette; sub-causes of one cause share its hue family.
CAUSE_COLORS: dict[str, str] = {
    a.PREFIX_DRIFT: "#D55E00",
    a.ROUTED_AWAY: "#0072B2",
    a.EVICTED: "#CC79A7",
    a.NOT_REPORTED: "#999999",
    a.COLD: "#56B4E9",
    a.BEYOND_HORIZON: "#A6CEE3",  # a paler sky blue: cold's kin (seen, but too long ago)
    a.BELOW_BLOCK: "#F0E442",
    a.UNAVOIDABLE: "#009E73",
    a.UNKNOWN: "#000000",
    # prefix_drift sub-causes: oranges and reds
    a.VOLATILE_SYSTEM: "#D55E00",
    a.SYSTEM_CHANGED: "#A63D00",
    a.TOOLS_REORDERED: "#E69F00",
    a.TOOLS_CHANGED: "#B07800",
    a.RAG_REORDERED: "#FF8C69",
    a.RAG_CHANGED: "#C0504D",
    a.HISTORY_TRUNCATED: "#8B4513",
    a.HISTORY_CHANGED: "#6B3410",
    a.CACHE_SALT_CHANGED: "#E07040",
    a.EVICTED_BEFORE_NEXT_TURN: "#A0527F",
}
FALLBACK_COLOR = "#7F7F7F"


def color(cause: str, sub_cause: str = "") -> str:
    """The colour of ``cause`` (or of its ``sub_cause`` when it has its own), as ``#RRGGBB``."""
    return CAUSE_COLORS.get(sub_cause) or CAUSE_COLORS.get(cause, FALLBACK_COLOR)


def label(cause: str, sub_cause: str = "") -> str:
    """``"cause"`` or ``"cause / sub_cause"``: how a cause is named in legends, tables and emails."""
    return f"{cause} / {sub_cause}" if sub_cause else cause


def color_map(labels: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``{label: colour}`` for labels made by :func:`label` (plotly's ``color_discrete_map``)."""
    out = {}
    for lab in labels:
        cause, _, sub = lab.partition(" / ")
        out[lab] = color(cause, sub)
    return out


# -- what to do about each cause --------------------------------------------------------------------------------
#: The safe order of adoption (docs/fix-first.md): stabilise prompt assembly, make the numbers known, keep a
#: conversation's prefix on one pod, then tune how long prefixes are held. A fix of an earlier stage comes first
#: when two findings of one tenant compete: routing by prefix only pays once the prefix is stable.
STAGE_PROMPT, STAGE_DATA, STAGE_ROUTING, STAGE_TTL = 1, 2, 3, 4
STAGE_NAMES = {
    STAGE_PROMPT: "stabilise prompt assembly",
    STAGE_DATA: "log what the cache did",
    STAGE_ROUTING: "keep a conversation's prefix on one pod",
    STAGE_TTL: "hold prefixes long enough",
}


@dataclass(frozen=True)
class Fix:
    """What an operator can do about one cause: the adoption ``stage`` and the advice in plain words.

    ``advice`` is a ``str.format`` template; the fields it may use are those of :func:`advice`.
    """

    stage: int
    advice: str


#: (cause, sub_cause) → fix; ("cause", "") is the fallback for a cause's other sub-causes. Causes absent here
#: (unavoidable, below_block, cold, beyond_horizon, unknown) have no fix: no prompt, routing or TTL change removes
#: them (a prefix that returns after more than the horizon is past what a pod's KV cache is expected to hold;
#: beyond_horizon only sizes what a longer-lived tier, such as KV offload to CPU memory, could serve).
FIXES: dict[tuple[str, str], Fix] = {
    (a.PREFIX_DRIFT, a.VOLATILE_SYSTEM): Fix(
        STAGE_PROMPT, "Move the volatile value (a timestamp, date or request id) out of the system prompt, after "
        "the stable part of the prompt: it changes on every request and invalidates everything after it."),
    (a.PREFIX_DRIFT, a.SYSTEM_CHANGED): Fix(
        STAGE_PROMPT, "Keep the system prompt byte-identical between requests: it changed beyond a volatile value, "
        "so every request re-computes it. Version it and change it deliberately."),
    (a.PREFIX_DRIFT, a.TOOLS_REORDERED): Fix(
        STAGE_PROMPT, "Serialize the tool schemas in a fixed order (sort the tools by name and the keys inside "
        "each schema): the same tools arrive in a different order, which the cache sees as a new prompt."),
    (a.PREFIX_DRIFT, a.TOOLS_CHANGED): Fix(
        STAGE_PROMPT, "Send the same tool list on every call of a conversation or agent run (it changed between "
        "calls), or put the tools that change after the stable ones."),
    (a.PREFIX_DRIFT, a.RAG_REORDERED): Fix(
        STAGE_PROMPT, "Order the retrieved documents deterministically (e.g. by document id): the same documents "
        "arrive in a different order."),
    (a.PREFIX_DRIFT, a.RAG_CHANGED): Fix(
        STAGE_PROMPT, "Put the retrieved documents after the stable instructions and history, or keep a "
        "per-customer document pack stable between turns: the documents changed between turns."),
    (a.PREFIX_DRIFT, a.HISTORY_TRUNCATED): Fix(
        STAGE_PROMPT, "Stop trimming the oldest turns on every request: each trim shifts the whole history and "
        "misses it. Trim less often and in larger steps, or summarise at fixed points."),
    (a.PREFIX_DRIFT, a.HISTORY_CHANGED): Fix(
        STAGE_PROMPT, "Send the conversation's earlier messages exactly as they were sent: the client edited or "
        "redacted the message its previous turn ended with, so everything from that message on missed. Redact "
        "before the first send, or append a correction instead of rewriting the message."),
    (a.PREFIX_DRIFT, a.CACHE_SALT_CHANGED): Fix(
        STAGE_PROMPT, "Keep a conversation's or agent run's cache_salt for its whole life: the salt changed "
        "between turns, and vLLM keys it into the first KV block, so the whole previous prompt missed. Rotate "
        "salts between conversations, not within one."),
    (a.PREFIX_DRIFT, ""): Fix(
        STAGE_PROMPT, "Keep the start of the prompt stable between requests: a segment before the new content "
        "changed."),
    (a.NOT_REPORTED, ""): Fix(
        STAGE_DATA, "Start vLLM with --enable-prompt-tokens-details (and make the gateway keep usage on streamed "
        "responses): without the cached count these requests' hits and misses are unknown."),
    (a.NOT_REPORTED, a.SKIP_READING_PREFIX_CACHE): Fix(
        STAGE_PROMPT, "Ask for prompt logprobs only where they are needed (scoring, evaluation): vLLM reads no "
        "prefix cache for a request with prompt_logprobs (or echo with logprobs), so it re-computes its whole "
        "prompt whatever the cache holds."),
    (a.NOT_REPORTED, a.SEVERAL_ENGINE_REQUESTS): Fix(
        STAGE_DATA, "These requests ran as several engine requests (n > 1, or a completions list of prompts): vLLM "
        "reports one sequence's cached count, not the request's, so their hits and misses are unknown (vLLM's own "
        "counters include them; see Data quality). Send one prompt per request where the hit count matters."),
    (a.ROUTED_AWAY, ""): Fix(
        STAGE_ROUTING, "Route each conversation or agent run to the pod that served its previous turn "
        "(prefix- or session-affinity routing): the prefix was cached on another pod."),
    (a.ROUTED_AWAY, a.POD_DOWN): Fix(
        STAGE_ROUTING, "Find why the pod that held the prefix was down (restarts, out-of-memory kills, failed "
        "probes) and bring it back sooner: the gateway found it down and had to send the request elsewhere, so "
        "the router was not at fault. A KV cache shared beyond one pod (offload to a shared tier) would keep such "
        "prefixes through an outage."),
    (a.EVICTED, a.EVICTED_BEFORE_NEXT_TURN): Fix(
        STAGE_TTL, "The previous turn's prefix was evicted during the wait before the next turn (a tool call or "
        "the user's reply): hold conversation and agent-run prefixes at least as long as that wait, or give the "
        "pod more KV-cache memory."),
    (a.EVICTED, ""): Fix(
        STAGE_TTL, "The prefix was evicted from the pod before the next request came: give the pod more KV-cache "
        "memory or fewer competing tenants, or hold agent and conversation prefixes longer."),
}


def fix_for(cause: str, sub_cause: str = "") -> Fix | None:
    """The fix of ``(cause, sub_cause)``, falling back to the cause's own; None when no fix removes the cause."""
    return FIXES.get((cause, sub_cause)) or FIXES.get((cause, ""))


def actionable(cause: str, sub_cause: str = "") -> bool:
    """Whether an operator can remove misses of this cause (it has a :data:`FIXES` entry)."""
    return fix_for(cause, sub_cause) is not None
