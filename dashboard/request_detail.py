"""One request's miss attribution with its evidence (named query ``request_detail``), drawn on the Miss causes page.

Shows the missed tokens by cause in prompt order (each cause in its colour from :mod:`dashboard.causes`), the
predecessor (id, arrival, pod, how it was found, with a link that opens its own detail), the pod that served the
request beside the predecessor's, the gap, each prompt segment's token counts and whether it matched the
predecessor's (the first that differs is the changed segment) and, where the gateway logged the prompt's structure,
which system lines and message chunks differ ("line 1 (52 tokens, new)"), the block size, the evidence behind the
cause, and what re-computing the missed tokens cost (GPU-seconds, and money when ``KVSCOPE_GPU_HOUR_PRICE`` is set).
Only ids, names and counts: never prompt text.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dashboard import charts, data, findings, fix_first, untrusted
from dashboard.causes import color, label
from ingest.attribution import (
    BEYOND_HORIZON,
    BEYOND_HORIZON_KIND_SUFFIX,
    EVICTED,
    POD_DOWN,
    PREFIX_DRIFT,
    ROUTED_AWAY,
)

PAGE = "views/miss_causes.py"
#: Colour of the cached (hit) part of the prompt in the prompt-order bar; not a cause.
CACHED_COLOR = "#D9D9D9"

#: How the attribution found the predecessor (request_attribution.predecessor_kind; docs/miss-causes.md).
KIND_TEXT = {
    "previous_turn": "the previous turn of the same conversation or agent run",
    "fingerprint": "the latest earlier request with the same prompt fingerprint",
    "variant": "the latest earlier request of the tenant with the same normalized system prompt, canonical tools "
    "or retrieval set",
}
#: A segment whose hash differs but whose variant matched: what the difference is.
VARIANT_TEXT = {
    "system": "differs only in masked volatile values (timestamps, ids)",
    "tools": "same tools, other order",
    "retrieval": "same documents, other order",
    "history": "continues the predecessor's conversation",
}


def fetch(request_id: str, f: data.Filters, ts: datetime | None = None) -> tuple[pl.DataFrame, bool]:
    """``(rows, in_window)``: the named query ``request_detail`` for ``request_id`` in the page's time range,
    else over all time (``in_window`` False); no tenant or pod filter. ``ts``: the request's arrival, when known
    (request ids can repeat across runs: a request is (request_id, ts)), read in the millisecond of ``ts``
    (``in_window`` then says whether it is in the page's range); without it, the id's request with the most
    missed tokens."""
    if ts is not None:
        at = ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
        window = f.params(tenant=False, pod=False, model=False)
        exact = {"since": _ch_ms(at), "until": _ch_ms(at + timedelta(milliseconds=1))}
        rows = data.named("request_detail", **exact, request_id=request_id)
        return rows, window["since"] <= exact["since"] < window["until"]  # same literal format: order is time order
    rows = data.named("request_detail", **f.params(tenant=False, pod=False, model=False), request_id=request_id)
    if not rows.is_empty():
        return rows, True
    return data.named("request_detail", request_id=request_id), False


def _ch_ms(t: datetime) -> str:
    """An aware time as the named queries' DateTime64(3) parameters read it (UTC, milliseconds)."""
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def gap_text(ms: float | None) -> str:
    """A gap in ms as "850 ms", "1.5 s", "12 min 5 s" or "2 h 3 min"; an en dash when None."""
    if ms is None:
        return charts.MISSING
    if abs(ms) < 1000:
        return f"{ms:,.0f} ms"
    s = ms / 1000
    if s < 60:
        return f"{s:,.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def compared(row: dict[str, Any]) -> str:
    """How a segment compares with the predecessor's, in words (from hash_matched / variant_matched)."""
    if row["hash_matched"] is None:
        return "no predecessor"
    if row["hash_matched"]:
        return "same"
    if row["segment"] == "suffix":
        return "differs: the new message"
    if row["variant_matched"]:
        return VARIANT_TEXT[row["segment"]]
    return "changed"


#: What a segment's logged parts are (request_detail segment_parts): system lines, chunks of the new message.
PART_NAME = {"system": "line", "suffix": "chunk"}


def changed_parts_text(row: dict[str, Any]) -> str:
    """The segment's lines / chunks that differ from the predecessor's at the same position, in words: "line 1
    (52 tokens, new)", "chunk 2 (20 tokens, moved)"; the predecessor's extra ones as "3 lines before, 4 now";
    '' when none differs or the gateway logged none (request_detail changed_parts / changed_part_tokens /
    changed_part_moved)."""
    part = PART_NAME.get(row["segment"])
    if part is None:
        return ""
    out = [f"{part} {i} ({n:,} token{'' if n == 1 else 's'}, {'moved' if moved else 'new'})"
           for i, n, moved in zip(row["changed_parts"], row["changed_part_tokens"], row["changed_part_moved"],
                                  strict=True)]
    now, before = row["segment_parts"], row["predecessor_segment_parts"]
    if now and before and before != now:
        out.append(f"{before} {part}s before, {now} now")
    return "; ".join(out)


def segment_table(rows: pl.DataFrame, changed: str) -> pl.DataFrame:
    """One row per segment in prompt order: tokens here and in the predecessor, how it compares, which lines /
    chunks differ (:func:`changed_parts_text`), missed tokens in it, and a mark on the changed segment."""
    out = [
        {
            "segment": r["segment"],
            "tokens": r["segment_tokens"],
            "predecessor_tokens": r["predecessor_segment_tokens"],
            "compared_with_predecessor": compared(r),
            "what_differs": changed_parts_text(r),
            "first_change": "◀ first change" if r["segment"] == changed else "",
            "missed_tokens": r["segment_missed_tokens"],
        }
        for r in rows.sort("segment_index").iter_rows(named=True)
    ]
    return pl.DataFrame(out, schema={"segment": pl.String, "tokens": pl.UInt64, "predecessor_tokens": pl.UInt64,
                                     "compared_with_predecessor": pl.String, "what_differs": pl.String,
                                     "first_change": pl.String,
                                     "missed_tokens": pl.UInt64})


def prompt_bar(head: dict[str, Any], key: str) -> None:
    """The prompt as one horizontal bar in token positions: the cached part, then each cause's missed tokens in
    prompt order, each in its cause's colour."""
    fig = go.Figure()
    cached = head["cached_tokens"]
    if cached:
        fig.add_bar(y=["prompt"], x=[cached], orientation="h", name="cached", marker_color=CACHED_COLOR,
                    hovertemplate="cached: %{x:,} tokens<extra></extra>")
    for cause, sub, n in zip(head["causes"], head["sub_causes"], head["cause_missed_tokens"], strict=True):
        name = label(cause, sub)
        fig.add_bar(y=["prompt"], x=[n], orientation="h", name=name, marker_color=color(cause, sub),
                    hovertemplate=f"{name}: %{{x:,}} tokens<extra></extra>")
    fig.update_layout(barmode="stack", height=170, title="Prompt tokens in prompt order: cached, then missed by cause",
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, legend={"orientation": "h", "y": -0.35},
                      xaxis_title="tokens", yaxis_visible=False)
    st.plotly_chart(fig, key=key)


def cause_table(head: dict[str, Any], price: float = 0.0, currency: str = "") -> pl.DataFrame:
    """The request's causes in prompt order with their missed tokens, share of its missed tokens and re-compute
    cost (``gpu_seconds``, None when unmeasured; a ``cost (<currency>)`` column when ``price``, per GPU-hour, > 0)."""
    total = sum(head["cause_missed_tokens"]) or 1
    df = pl.DataFrame(
        {"cause": head["causes"], "sub_cause": head["sub_causes"], "missed_tokens": head["cause_missed_tokens"],
         "share_of_request_missed": [n / total for n in head["cause_missed_tokens"]],
         "gpu_seconds": head["cause_gpu_seconds"]},
        schema={"cause": pl.String, "sub_cause": pl.String, "missed_tokens": pl.UInt64,
                "share_of_request_missed": pl.Float64, "gpu_seconds": pl.Float64},
    )
    return findings.with_cost_column(df, price, currency)


def _precise_text(head: dict[str, Any]) -> list[str]:
    """The precise-mode sentence (evidence kv_events: the prompt's blocks matched against the KV events)."""
    if head.get("evidence") != "kv_events":
        return []
    holder = charts.name(head.get("evidence_pod") or "")
    if not holder:
        return ["The prompt's blocks were matched against the pods' KV events: no pod held its first missed block "
                "at arrival."]
    left = head.get("evidence_removed_at")
    return [f"The prompt's blocks were matched against the pods' KV events: **{holder}** held the first missed "
            "block" + (f"; it left {holder} at {left:%Y-%m-%d %H:%M:%S} UTC." if left else " at arrival.")]


def _pod_down_text(head: dict[str, Any]) -> list[str]:
    """For a request with a ``routed_away / pod_down`` part: which pods the gateway found down as it routed it (the
    request's ``pods_down``; the part's prefix was held on one of them), else nothing."""
    if POD_DOWN not in (head.get("sub_causes") or ()):
        return []
    down = [charts.name(p) for p in head.get("pods_down") or ()]
    named = ", ".join(f"**{p}**" for p in down) or "a pod"
    return [f"The gateway found {named} down when it routed this request (pods_down), and the part of the prefix "
            "held there reads `routed_away / pod_down`: an outage lost that hit, not the routing policy."]


def evidence(head: dict[str, Any], segments: pl.DataFrame) -> str:
    """What the attribution's answer rests on, in words: how the predecessor was found; for a drift, the
    segment comparison; for a prefix that was reusable (routed_away, evicted), which pod held it and what that
    pod's KV events say (or that the cause is inferred from which pod served the predecessor)."""
    pred = charts.name(head["predecessor_request_id"])
    pod, pred_pod = charts.name(head["pod"], empty="(no pod)"), charts.name(head["predecessor_pod"], empty="(no pod)")
    precise = [*_precise_text(head), *_pod_down_text(head)]
    if not pred:
        return "  \n".join([*precise, "No earlier request within the attribution lookback shared this prefix: the "
                             "rest of its stable prefix is **cold**." if precise else
                             "No earlier request within the attribution lookback shared this prefix: its stable "
                             "prefix is **cold**."])
    causes = set(head["causes"])
    stored = head["predecessor_kind"] or ""
    plain = stored.removesuffix(BEYOND_HORIZON_KIND_SUFFIX)
    kind = KIND_TEXT.get(plain, plain or "an earlier request")
    lines = [*precise, f"Predecessor found as {kind}."]
    if stored != plain:
        lines.append(f"No predecessor lay within the attribution horizon; this one, found further back, is "
                     f"{gap_text(head['gap_ms'])} old: what it shared is **{BEYOND_HORIZON}**, not a prefix a pod "
                     "is expected to still hold.")
    changed = head["changed_segment"]
    if PREFIX_DRIFT in causes and changed:
        seg = segments.filter(pl.col("segment") == changed).to_dicts()
        how = seg[0]["compared_with_predecessor"] if seg else "changed"
        parts = seg[0]["what_differs"] if seg else ""
        lines.append(f"The drift is named by the segment hashes: **{changed}** is the first segment that differs "
                     f"({how})" + (f"; in it: {parts}." if parts else "."))
    if pod != pred_pod:
        lines.append(f"This request went to **{pod}**, the predecessor to **{pred_pod}**: another pod held the "
                     "prefix.")
    else:
        lines.append(f"Both went to **{pod}**.")
    if head["kv_events"]:
        lines.append(
            f"{pred_pod} sent {head['kv_events']:,} KV-cache events between the two requests: "
            f"{head['kv_blocks_stored']:,} blocks stored, {head['kv_blocks_removed']:,} removed (evicted)"
            + (f", {head['kv_caches_cleared']:,} full cache clears" if head["kv_caches_cleared"] else "") + "."
        )
    elif causes & {ROUTED_AWAY, EVICTED}:
        lines.append(f"No KV-cache events from {pred_pod} between the two requests: the cause is inferred from "
                     "which pod served the predecessor.")
    return "  \n".join(lines)


def predecessor_link(head: dict[str, Any]) -> None:
    """A link that opens the predecessor's detail on this page, keeping the page's other URL parameters."""
    pred = head["predecessor_request_id"]
    if not pred:
        return
    params = {k: v for k, v in st.query_params.to_dict().items() if k not in ("request_id", "ts")}
    params["request_id"] = pred
    if head.get("predecessor_ts") is not None:  # ids can repeat across runs: the predecessor is (id, ts)
        params["ts"] = findings.ts_param(head["predecessor_ts"])
    st.page_link(PAGE, label=f"Open predecessor {charts.name(pred)}", icon=":material/history:",
                 query_params=params)


def header(head: dict[str, Any], in_window: bool, price: float = 0.0, currency: str = "") -> None:
    """Title and one caption line: tenant, model, pod, arrival, token counts, block size and what re-computing
    its missed tokens cost (:func:`dashboard.findings.cost_text`)."""
    cached = head["cached_tokens"]
    cost = findings.cost_text(head["gpu_seconds"], findings.money(head["gpu_seconds"], price), currency)
    st.subheader(f"Request {charts.name(head['request_id'])}")
    st.caption(
        f"{charts.name(head['tenant_id'], empty=untrusted.NO_TENANT)} · "
        f"{charts.name(head['model'], empty='(no model)')}"
        f" · served by **{charts.name(head['pod'], empty='(no pod)')}** · arrived "
        f"{head['ts']:%Y-%m-%d %H:%M:%S} UTC · {charts.count(head['prompt_tokens'])} prompt tokens, "
        f"{'cached count not reported' if cached is None else charts.count(cached) + ' cached'} · block size "
        f"{head['block_size']} tokens · its missed tokens cost {cost}"
        + ("" if in_window else " · outside the chosen time range")
    )


def predecessor(head: dict[str, Any]) -> None:
    cols = st.columns(4)
    pred_ts = head["predecessor_ts"]
    cols[0].metric("Predecessor", charts.name(head["predecessor_request_id"], empty="none"))  # values are markdown
    cols[1].metric("Its arrival (UTC)", charts.MISSING if pred_ts is None else f"{pred_ts:%H:%M:%S}",
                   help=None if pred_ts is None else f"{pred_ts:%Y-%m-%d %H:%M:%S.%f}"[:-3])
    cols[2].metric("Pod: this / predecessor",
                   f"{charts.name(head['pod'])} / {charts.name(head['predecessor_pod'], empty=charts.MISSING)}")
    cols[3].metric("Gap", gap_text(head["gap_ms"]), help="from the predecessor's end (arrival + e2e latency) to "
                   "this request's arrival")


def render(request_id: str, f: data.Filters, ts: datetime | None = None) -> None:
    """The detail of the request ``(request_id, ts)`` (``ts`` None: by its id alone, see :func:`fetch`; see the
    module docstring); says so when the request has no answer yet."""
    rows, in_window = fetch(request_id, f, ts)
    if rows.is_empty():
        st.info(f"No miss attribution for request {charts.name(request_id)}: no such request id, or the "
                "attribution job has not answered it yet.", icon=":material/search_off:")
        return
    head = rows.row(0, named=True)
    price, currency = fix_first.gpu_hour_price()
    header(head, in_window, price, currency)
    prompt_bar(head, key="request_prompt_bar")
    charts.table(cause_table(head, price, currency), percent_cols=["share_of_request_missed"], key="request_causes")
    predecessor(head)
    predecessor_link(head)
    changed = head["changed_segment"]
    segments = segment_table(rows, changed)
    st.markdown("**Segments** (in prompt order; token counts from the gateway log, never text)"
                + (f": the first that differs from the predecessor's is **{changed}**." if changed else "."))
    charts.table(segments, key="request_segments")
    st.markdown(f"**Evidence.** {evidence(head, segments)}")
