"""Miss-cause attribution over whole columns (the attribution job's hot path): the rules of
:func:`ingest.attribution.judge`, applied to a chunk of requests at once with numpy, so a core attributes
~10^5 requests per second instead of ~10^4. :mod:`ingest.attribution` stays the readable reference; a test
checks that both give the same answer for every request of random traffic.

Input: one polars DataFrame, a row per target request with its own fields (:data:`TARGET_FIELDS` suffice)
and its chosen predecessor's fields prefixed ``p_`` (null when it has none; those of :data:`PREDECESSOR_FIELDS`
suffice), ``predecessor_kind`` ("" when none; the plain kind), optionally ``beyond_horizon`` (true when the
predecessor was found beyond the horizon; absent or null = false) and ``block_size`` (tokens per KV block of
its pod). Output: :func:`judge_frame` returns the verdict columns (:data:`ingest.attribution.VERDICT_COLUMNS`).

Precise mode (KV-event evidence, docs/miss-causes.md): the rows that have evidence (:class:`EvidenceFrames`,
or a mapping request_id → :class:`ingest.attribution.KvEvidence`) are judged column-wise too: each missed block's
state gives its zone (:func:`ingest.attribution.kv_evidence_zones`), the fingerprints' zones follow from the
evidence's end, with routed_away / evicted read as cold when the predecessor's pod is covered
(``_precise_reuse_cause``), and equal (cause, sub_cause) pairs add up in order of first appearance, as
:func:`ingest.attribution.split_missed_tokens` totals them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from ingest import attribution_structure as structure
from ingest.attribution import (
    BELOW_BLOCK,
    BEYOND_HORIZON,
    BEYOND_HORIZON_KIND_SUFFIX,
    CACHE_RESET,
    CACHE_SALT_CHANGED,
    CAUSES,
    CHUNK_HASHES,
    COLD,
    EVICTED,
    EVICTED_BEFORE_NEXT_TURN,
    EVIDENCE_FINGERPRINTS,
    EVIDENCE_INFERRED,
    EVIDENCE_KV_EVENTS,
    HISTORY_CHANGED,
    LINE_HASHES,
    NOT_REPORTED,
    NOWHERE,
    POD_DOWN,
    PREFIX_DRIFT,
    PREVIOUS_TURN,
    REMOVED_HERE,
    REQUEST_FIELDS,
    RESET_HERE,
    RESIDENT_AT_ARRIVAL,
    RESIDENT_ELSEWHERE,
    RESIDENT_HERE,
    ROUTED_AWAY,
    SEVERAL_ENGINE_REQUESTS,
    SKIP_READING_PREFIX_CACHE,
    STABLE_SEGMENTS,
    SUB_CAUSES,
    UNAVOIDABLE,
    UNKNOWN,
    BlockStatus,
    KvEvidence,
)

_HASHES = [s.hash_field for s in STABLE_SEGMENTS]
#: Cause, sub-cause and evidence names as small integer codes while a chunk is judged (0 = ""): numpy compares
#: and selects int16 columns in C, object columns of Python strings one reference at a time (a chunk of 5·10^5
#: requests judged in 0.65 CPU-s instead of 1.31). Names map to Arrow strings once, at the end (:func:`_names`).
_NAMES: list[str] = [""]
_CODES: dict[str, int] = {"": 0}
_CODES_LOCK = threading.Lock()


def _code(name: str) -> int:
    """The code of a cause or sub-cause name (registered on first use)."""
    code = _CODES.get(name)
    if code is None:
        with _CODES_LOCK:
            code = _CODES.setdefault(name, len(_NAMES))
            if code == len(_NAMES):
                _NAMES.append(name)
    return code


def _codes(values: np.ndarray) -> np.ndarray:
    """An array of names (object or str) as an int16 array of codes."""
    out = np.zeros(len(values), dtype=np.int16)
    for name in set(values.tolist()):
        if name:
            out[values == name] = _code(name)
    return out


def _names(codes: np.ndarray) -> pa.Array:
    """Codes as an Arrow string array (the names, in C)."""
    return pa.array(_NAMES, type=pa.string()).take(pa.array(codes, type=pa.int16()))


for _name in (*CAUSES, *SUB_CAUSES):  # every name a verdict can hold, registered before any thread judges
    _code(_name)
#: The target's own fields (of :data:`ingest.attribution.REQUEST_FIELDS`) :func:`judge_frame` and precise mode
#: read: all but the ids and the fingerprint, which only make predecessor keys (computed in the store,
#: gateway_requests.predecessor_keys; a caller may leave them out).
TARGET_FIELDS = tuple(f for f in REQUEST_FIELDS
                      if f not in ("conversation_id", "agent_run_id", "prompt_fingerprint", "first_message_hash"))
#: The predecessor's fields (of :data:`ingest.attribution.REQUEST_FIELDS`) :func:`judge_frame` reads, as its
#: ``p_`` columns: a caller may give only these (the attribution job reads no others of a predecessor).
PREDECESSOR_FIELDS = (
    "request_id", "ts", "pod", "prompt_tokens", "e2e_ms",
    *(f for s in STABLE_SEGMENTS for f in (s.hash_field, s.tokens_field, s.variant_field) if f),
    "suffix_hash", "suffix_tokens", "next_history_hash", "continue_final_message", "cache_salt_hash", LINE_HASHES,
    CHUNK_HASHES, "prev_history_hash", "prev_suffix_hash",
)
_TOKENS = [s.tokens_field for s in STABLE_SEGMENTS] + ["suffix_tokens"]
HISTORY = 3


def _i(df: pl.DataFrame, col: str) -> np.ndarray:
    """An integer column as int64, nulls and negatives as 0 (the reference's ``_int``)."""
    return np.maximum(df[col].fill_null(0).cast(pl.Int64).to_numpy(), 0)


def _eq(df: pl.DataFrame, a: str, b: str) -> np.ndarray:
    """Elementwise string equality, null read as "" (the reference's ``_str``)."""
    return (df[a].fill_null("") == df[b].fill_null("")).to_numpy()


def _nonempty(df: pl.DataFrame, col: str) -> np.ndarray:
    return (df[col].fill_null("") != "").to_numpy()


def _full(tokens: np.ndarray, block: np.ndarray) -> np.ndarray:
    return np.maximum(tokens, 0) // block * block


def _offsets(df: pl.DataFrame, prompt: np.ndarray, prefix: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Segment boundaries scaled to prompt_tokens (shape (n, 6)) and a mask of rows with segment counts (of the
    predecessor's columns with ``prefix`` "p_")."""
    counts = np.stack([_i(df, prefix + c) for c in _TOKENS], axis=1)
    total = counts.sum(axis=1)
    cum = np.concatenate([np.zeros((len(df), 1), dtype=np.int64), np.cumsum(counts, axis=1)], axis=1)
    safe = np.where(total == 0, 1, total)
    return cum * prompt[:, None] // safe[:, None], total > 0


def _scaled(df: pl.DataFrame, prompt: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Raw segment-token positions scaled like the boundaries (the reference's ``_scaled``)."""
    total = sum(_i(df, c) for c in _TOKENS)
    return np.where(total > 0, raw * prompt // np.where(total == 0, 1, total), 0)


def continuation(df: pl.DataFrame, prev_turn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(continues, edited) per row of ``df`` (a request's columns and its previous turn's as ``p_`` columns), where
    ``prev_turn``: as :func:`ingest.attribution._history_continues` and ``_previous_message_edited`` read them.
    Continues: its history is the previous turn's with that turn's final message as sent, or that turn's messages
    re-sent with no reply between (its ``next_history_hash``), or its assistant prefill completed. Edited: the
    history kept but the final message not as it was sent (``history_changed``). A column left out (an older log):
    that reading is not made."""
    n = len(df)
    kept = prev_turn & _eq(df, "prev_history_hash", "p_history_prefix_hash")
    # the previous turn's messages re-sent as this history with no reply between (its next_history_hash)
    no_reply = prev_turn & _nonempty(df, "p_next_history_hash") \
        & _eq(df, "history_prefix_hash", "p_next_history_hash") if "p_next_history_hash" in df.columns \
        else np.zeros(n, dtype=bool)
    # the previous turn's final message not as it was sent (edited, redacted): history_changed, not continued
    edited = kept & ~no_reply & _nonempty(df, "prev_suffix_hash") & _nonempty(df, "p_suffix_hash") \
        & ~_eq(df, "prev_suffix_hash", "p_suffix_hash") if "prev_suffix_hash" in df.columns else np.zeros(n, dtype=bool)
    # the previous turn was an assistant prefill this history carries completed (_prefill_completed)
    prefilled = prev_turn & _nonempty(df, "prefill_history_hash") \
        & df["p_continue_final_message"].fill_null(False).cast(pl.Boolean).to_numpy() \
        & _eq(df, "prefill_history_hash", "p_history_prefix_hash") \
        if "p_continue_final_message" in df.columns and "prefill_history_hash" in df.columns \
        else np.zeros(n, dtype=bool)
    return (kept & ~edited) | no_reply | prefilled, edited


def _shared(df: pl.DataFrame, prompt: np.ndarray, off: np.ndarray, has_pred: np.ndarray,
            prev_turn: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(S, drift sub-cause's code or 0, W, identical) per row, as :func:`ingest.attribution.shared_prefix`
    computes them (identical: every segment and the suffix raw-equal, so S is exact)."""
    n = len(df)
    cap = np.minimum(prompt, _i(df, "p_prompt_tokens"))
    raw_eq = [_eq(df, h, "p_" + h) for h in _HASHES]
    var_eq = [_nonempty(df, s.variant_field) & _eq(df, s.variant_field, "p_" + s.variant_field)
              if s.variant_field else np.zeros(n, dtype=bool) for s in STABLE_SEGMENTS]
    continues, edited = continuation(df, prev_turn)
    # back one turn (a regenerate or an edit of an earlier message): this history is the predecessor's previous
    # turn's (_rewound), held by the predecessor up to its end, or to the prompt's end when the final message is the
    # one the predecessor carried (_rewind_end)
    rewound = prev_turn & ~continues & ~edited & _eq(df, "history_prefix_hash", "p_prev_history_hash") \
        if "p_prev_history_hash" in df.columns else np.zeros(n, dtype=bool)
    again = _nonempty(df, "p_prev_suffix_hash") & _eq(df, "suffix_hash", "p_prev_suffix_hash") \
        if "p_prev_suffix_hash" in df.columns else np.zeros(n, dtype=bool)
    rewind_end = np.where(again, prompt, off[:, HISTORY + 1])
    suffix_eq = _eq(df, "suffix_hash", "p_suffix_hash")
    tail = np.where(suffix_eq, prompt, off[:, HISTORY + 1])
    shift = sum(_i(df, s.tokens_field) - _i(df, "p_" + s.tokens_field) for s in STABLE_SEGMENTS[:HISTORY])
    continued_end = np.minimum(prompt, _i(df, "p_prompt_tokens") + shift)

    first = np.full(n, len(STABLE_SEGMENTS))  # first segment whose raw hash differs (4 = none)
    for i in range(len(STABLE_SEGMENTS) - 1, -1, -1):
        first = np.where(~raw_eq[i], i, first)
    s_out = np.minimum(cap, tail)
    drift = np.zeros(n, dtype=np.int16)
    w_out = s_out.copy()

    hist = first == HISTORY
    s_out = np.where(hist & continues, cap, s_out)
    w_out = np.where(hist & continues, cap, w_out)
    other_kind = hist & ~continues & ~prev_turn
    s_out = np.where(other_kind, np.minimum(cap, off[:, HISTORY]), s_out)
    w_out = np.where(other_kind, np.minimum(cap, off[:, HISTORY]), w_out)
    s_out = np.where(hist & rewound, np.minimum(cap, rewind_end), s_out)
    w_out = np.where(hist & rewound, np.minimum(cap, rewind_end), w_out)

    drifted = (first < HISTORY) | (hist & ~continues & ~rewound & prev_turn)
    line_at, line_volatile = _on_rows(df, has_pred & (first == 0), structure.system_lines, (0, False))
    # retrieved documents in the system prompt after an unchanged head (structure.system_documents), read only where
    # the normalized system prompt differs: named rag_reordered / rag_changed before the line rule's volatile
    documents, documents_end, new_after, same_head = _on_rows(df, has_pred & (first == 0) & ~var_eq[0],
                                                              structure.system_documents, ("", 0, False, False))
    # found on the system prompt's head alone (ingest.attribution.head_only): without documents it had, the rest is
    # new content, no drift
    head_only = has_pred & (first == 0) & ~prev_turn & ~var_eq[0] & same_head & (documents == 0) & ~var_eq[1] \
        & ~var_eq[2]
    if head_only.any():
        head_only &= ~_on_rows(df, head_only, lambda f: (structure.lines_match(f),), (False,))[0]
    var_eq[0] = var_eq[0] | (line_volatile & (documents == 0))  # the structure names a volatile change too
    d = np.minimum(cap, np.where(first == 0, _scaled(df, prompt, line_at),
                                 off[np.arange(n), np.minimum(first, HISTORY)]))
    # where the predecessor's final message started in this request (its own offsets, shifted like
    # continued_end), as the reference: the drift's start, or W's end after an earlier change
    edited_at = off[:, HISTORY]
    if edited.any():
        p_off, p_counted = _offsets(df, _i(df, "p_prompt_tokens"), "p_")
        edited_at = np.where(p_counted, p_off[:, HISTORY + 1] + shift, off[:, HISTORY])
    d = np.where(edited & hist, np.minimum(cap, edited_at), d)
    for i, seg in enumerate(STABLE_SEGMENTS):
        at = drifted & (first == i)
        name = seg.reordered if seg.variant_field else seg.changed
        drift[at] = np.where(var_eq[i][at], _code(name), _code(seg.changed)) if seg.variant_field \
            else _code(seg.changed)
    w = _reusable_without_drift(first, raw_eq, var_eq, continues, continued_end, tail, off,
                                edited, np.minimum(prompt, np.maximum(off[:, HISTORY], edited_at)),
                                rewound, np.minimum(prompt, rewind_end))
    drift[edited & hist] = _code(HISTORY_CHANGED)
    w = np.where(edited & hist, np.minimum(cap, off[:, HISTORY + 1]), w)
    s_out = np.where(head_only, d, s_out)
    w_out = np.where(head_only, d, w_out)
    drifted = drifted & ~head_only
    drift = np.where(head_only, 0, drift)
    in_documents = drifted & (first == 0) & (documents != 0)
    drift = np.where(in_documents, documents, drift)
    # documents the predecessor did not have follow the drift: new content from there
    w = np.where(in_documents & new_after, _scaled(df, prompt, documents_end), w)
    s_out = np.where(drifted, d, s_out)
    # a segment the predecessor did not have (added before content it had) is new content: what the change
    # displaced is at most the predecessor's prompt, so W stops there (the rest of the added segment: unavoidable)
    added = np.zeros(n, dtype=bool)
    for i, seg in enumerate(STABLE_SEGMENTS[:HISTORY]):
        added |= (first == i) & ~_nonempty(df, "p_" + seg.hash_field)
    w_out = np.where(drifted, np.maximum(d, np.where(added, np.minimum(cap, w), w)), w_out)
    # every stable segment equal, the suffix differs: its chunks (structure.suffix_chunks)
    in_suffix = (first == len(STABLE_SEGMENTS)) & ~suffix_eq
    stable, suffix = sum(_i(df, c) for c in _TOKENS[:HISTORY + 1]), _i(df, "suffix_tokens")
    shared, rag, end = _on_rows(df, has_pred & in_suffix, structure.suffix_chunks, (0, "", 0))
    s_rag = np.minimum(cap, _scaled(df, prompt, stable + np.minimum(shared, suffix)))
    s_out = np.where(in_suffix, s_rag, s_out)
    w_out = np.where(in_suffix, np.maximum(s_rag, np.where(rag != 0, _scaled(
        df, prompt, stable + np.minimum(end, suffix)), s_rag)), w_out)
    drift = np.where(in_suffix, rag, drift)
    identical = has_pred & (first == len(STABLE_SEGMENTS)) & suffix_eq
    # a previous turn under another cache_salt shares nothing: the cache key changed at the first block
    salt = prev_turn & ~_eq(df, "cache_salt_hash", "p_cache_salt_hash") if "cache_salt_hash" in df.columns \
        else np.zeros(n, dtype=bool)
    s_out, drift, identical = (np.where(salt, 0, s_out), np.where(salt, _code(CACHE_SALT_CHANGED), drift),
                               identical & ~salt)
    return np.where(has_pred, s_out, 0), np.where(has_pred, drift, 0), np.where(has_pred, w_out, 0), identical


def _on_rows(df: pl.DataFrame, mask: np.ndarray, rule, defaults: tuple) -> tuple[np.ndarray, ...]:
    """``rule`` (a column-wise function of :mod:`ingest.attribution_structure`) computed on the rows of ``mask``
    only (the structural rules matter only where the segment they read differs), ``defaults`` elsewhere; a
    column of names comes back as codes (:func:`_code`)."""
    out = [np.full(len(df), _code(d) if isinstance(d, str) else d, dtype=np.int16 if isinstance(d, str) else type(d))
           for d in defaults]
    if mask.any():
        for column, values, d in zip(out, rule(df.filter(pl.Series(mask))), defaults, strict=True):
            column[mask] = _codes(np.asarray(values)) if isinstance(d, str) else values
    return tuple(out)


def _reusable_without_drift(first: np.ndarray, raw_eq: list[np.ndarray], var_eq: list[np.ndarray],
                            continues: np.ndarray, continued_end: np.ndarray, tail: np.ndarray,
                            off: np.ndarray, edited: np.ndarray, edited_end: np.ndarray, rewound: np.ndarray,
                            rewind_end: np.ndarray) -> np.ndarray:
    """W: from the segment after the first change, the end of the run of raw-equal or nameably-changed
    segments (a continued history reaches the predecessor's whole prompt; one whose previous final message was
    edited, where that message started: ``edited_end``; one back one turn, ``rewind_end``)."""
    n = len(first)
    out = tail.copy()
    done = np.zeros(n, dtype=bool)
    for j in range(1, len(STABLE_SEGMENTS)):
        active = (j > first) & ~done
        if j == HISTORY:
            stop = active & ~raw_eq[j]
            out = np.where(stop, np.where(continues, continued_end, np.where(
                edited, edited_end, np.where(rewound, rewind_end, off[:, j]))), out)
        else:
            stop = active & ~raw_eq[j] & ~var_eq[j]
            out = np.where(stop, off[:, j], out)
        done |= stop
    return out


def _zones(prompt: np.ndarray, cached: np.ndarray, block: np.ndarray, stable: np.ndarray, has_counts: np.ndarray,
           has_pred: np.ndarray, s: np.ndarray, drift: np.ndarray, w: np.ndarray, identical: np.ndarray,
           reuse: np.ndarray, reuse_sub: np.ndarray, start: np.ndarray
           ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(tokens, cause, sub_cause) per zone, in prompt order, as :func:`ingest.attribution.split_missed_tokens`
    (``identical``: no edge tolerance, S is exact); ``start``: where they begin (tokens: the end of precise
    mode's block zones, else 0). Causes, sub-causes, ``drift``, ``reuse`` and ``reuse_sub`` as codes
    (:func:`_code`)."""
    last = _full(prompt - 1, block)
    n = len(prompt)
    short = last == 0  # shorter than a block plus the last token: nothing can hit
    s = np.minimum(np.maximum(s, 0), prompt)
    below = has_pred & (s > 0) & (s < block)
    r = _full(np.minimum(s, prompt - 1), block)
    r = np.where(~identical & (cached > 0) & (r - block <= cached) & (cached < r), cached, r)
    t = np.minimum(np.maximum(stable, 0), prompt - 1)
    below_t = (t > 0) & (t < block)
    no_pred_end = np.where(below_t, t, _full(t, block))
    no_pred_cause = np.where(below_t, _code(BELOW_BLOCK), _code(COLD))
    end1 = np.where(short, prompt - 1, np.where(~has_counts, last, np.where(
        ~has_pred, no_pred_end, np.where(below, np.minimum(s, prompt - 1), r))))
    cause1 = np.where(short, _code(BELOW_BLOCK), np.where(~has_counts, _code(UNKNOWN), np.where(
        ~has_pred, no_pred_cause, np.where(below, _code(BELOW_BLOCK), reuse)))).astype(np.int16)
    sub1 = np.where(~short & has_counts & has_pred & ~below, reuse_sub, 0).astype(np.int16)
    has_drift = ~short & has_counts & has_pred & (drift != 0)
    end2 = np.where(has_drift, _full(np.minimum(w, prompt - 1), block), 0)
    out = []
    for end, cause, sub in ((end1, cause1, sub1), (end2, np.full(n, _code(PREFIX_DRIFT), dtype=np.int16), drift),
                            (prompt, np.full(n, _code(UNAVOIDABLE), dtype=np.int16), np.zeros(n, dtype=np.int16))):
        end = np.maximum(start, end)
        out.append((np.maximum(0, end - np.maximum(start, cached)), cause, sub))
        start = end
    return out


def _lists(zones: list[tuple[np.ndarray, np.ndarray, np.ndarray]], attributable: np.ndarray,
           whole: list[tuple[np.ndarray, str, str, np.ndarray]], first: tuple[np.ndarray, np.ndarray, np.ndarray]
           ) -> tuple[pa.ListArray, pa.ListArray, pa.ListArray]:
    """The zones as three Arrow list columns (causes, sub_causes, missed_tokens), empty zones left out, equal
    (cause, sub_cause) pairs added up (:func:`_merge`), built from flat arrays and offsets (no per-row Python).
    ``first``: (n, k) slots of tokens / causes / sub_causes before the zones (precise mode's blocks). ``whole``:
    (rows, cause, sub_cause, tokens) of requests that get one entry instead of zones: cached tokens beyond what
    vLLM can hit at the block size (``unknown``, the missed tokens), a cached count not reported
    (``not_reported``, the prompt tokens; sub-cause ``skip_reading_prefix_cache`` when vLLM read no cache,
    ``several_engine_requests`` when it ran the request as several engine requests). A
    later entry replaces an earlier one on the rows both name. Causes and sub-causes in as codes (:func:`_code`),
    out as names."""
    tok = np.concatenate([first[0], np.stack([z[0] for z in zones], axis=1)], axis=1)
    cause = np.concatenate([first[1], np.stack([z[1] for z in zones], axis=1)], axis=1)
    sub = np.concatenate([first[2], np.stack([z[2] for z in zones], axis=1)], axis=1)
    _merge(tok, cause, sub)
    n = len(tok)
    tok[~attributable] = 0
    for rows, name, sub_name, tokens in whole:
        tok[rows] = 0
        tok[rows, 0] = tokens[rows]
        cause[rows, 0], sub[rows, 0] = _code(name), _code(sub_name) if sub_name else 0
    keep = tok > 0
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(keep.sum(axis=1), out=offsets[1:])
    return (pa.ListArray.from_arrays(offsets, _names(cause[keep])),
            pa.ListArray.from_arrays(offsets, _names(sub[keep])),
            pa.ListArray.from_arrays(offsets, pa.array(tok[keep], type=pa.uint32())))


@dataclass(frozen=True)
class EvidenceFrames:
    """Precise mode's evidence for many requests, as two frames. ``requests``: request_id, block_size (of the
    chain, Int64), covered (list of the pods whose KV events cover the arrival); ``blocks``: request_id, i (0, 1,
    ... from block cached // block_size on), state (:data:`ingest.attribution.BLOCK_STATES`), pod, removed_at
    (unix ms or null): :attr:`ingest.attribution.KvEvidence.blocks` row by row. Both may also carry ``t`` (the
    arrival, unix ms): a request is then matched by (request_id, t), so two gateway rows of one request_id (a
    retry logged under the same id) are two requests, as the job counts them."""

    requests: pl.DataFrame
    blocks: pl.DataFrame

    @staticmethod
    def from_mapping(evidence: Mapping[str, KvEvidence]) -> EvidenceFrames:
        """The frames of request_id → :class:`ingest.attribution.KvEvidence`."""
        ids = list(evidence)
        requests = pl.DataFrame({"request_id": ids, "block_size": [evidence[r].block_size for r in ids],
                                 "covered": [sorted(evidence[r].covered_pods) for r in ids]},
                                schema={"request_id": pl.String, "block_size": pl.Int64, "covered": pl.List(pl.String)})
        rows = [(r, i, b.state, b.pod, None if b.removed_at is None else round(b.removed_at.timestamp() * 1000))
                for r in ids for i, b in enumerate(evidence[r].blocks)]
        blocks = pl.DataFrame(rows, schema={"request_id": pl.String, "i": pl.Int64, "state": pl.String,
                                            "pod": pl.String, "removed_at": pl.Int64}, orient="row")
        return EvidenceFrames(requests, blocks)

    def to_mapping(self) -> dict[str, KvEvidence]:
        """request_id → :class:`ingest.attribution.KvEvidence` (for the reference judge and tests)."""
        blocks: dict[str, list[BlockStatus]] = {}
        for r, state, pod, removed in self.blocks.sort("request_id", "i").select(
                "request_id", "state", "pod", "removed_at").iter_rows():
            at = None if removed is None else datetime.fromtimestamp(removed / 1000, UTC)
            blocks.setdefault(r, []).append(BlockStatus(state, pod, at))
        return {r: KvEvidence(size, tuple(blocks.get(r, ())), frozenset(covered))
                for r, size, covered in self.requests.select("request_id", "block_size", "covered").iter_rows()}


def judge_frame(df: pl.DataFrame, evidence: EvidenceFrames | Mapping[str, KvEvidence] | None = None,
                chains: ChainReader | None = None) -> dict[str, Any]:
    """Verdict columns for every row of ``df`` (see the module docstring), as lists/arrays keyed by
    :data:`ingest.attribution.VERDICT_COLUMNS`, in row order. ``evidence``: the KV evidence of the rows judged
    in precise mode. ``chains``: reads what the block chains of the rows whose segments claim a drift prove
    (:data:`ChainReader`; the store job's); without it, from the chain columns of ``df`` if it has them. Pure but
    for ``chains``; raises only on a frame that lacks a column."""
    if evidence is not None and not isinstance(evidence, EvidenceFrames):
        evidence = EvidenceFrames.from_mapping(evidence) if evidence else None
    return _judge_columns(df, evidence, chains)


#: Block state → (cause, sub_cause) of its zone (ingest.attribution.kv_evidence_zones); None = the predecessor's.
#: The last, :data:`_HELD_BY_DOWN`, is a block resident elsewhere whose holder was down as the request was routed.
_HELD_BY_DOWN = "resident_elsewhere_down"
_STATE_ZONES = {REMOVED_HERE: (EVICTED, None), RESET_HERE: (EVICTED, CACHE_RESET),
                RESIDENT_ELSEWHERE: (ROUTED_AWAY, ""), RESIDENT_HERE: (UNKNOWN, RESIDENT_AT_ARRIVAL),
                _HELD_BY_DOWN: (ROUTED_AWAY, POD_DOWN)}


@dataclass
class _Precise:
    """Per row of the frame: ``rows`` judged in precise mode, the predecessor's pod ``covered``, the evidence's
    end (tokens, ``start``), its zones as (n, 4) slots of tokens / causes / sub_causes (codes, :func:`_code`)
    in order of first appearance ((n, 0) without evidence), and the first block's pod and departure (unix ms,
    −1 = none)."""

    rows: np.ndarray
    covered: np.ndarray
    start: np.ndarray
    zones: tuple[np.ndarray, np.ndarray, np.ndarray]
    pod: np.ndarray
    removed_at: np.ndarray


def _precise(df: pl.DataFrame, frames: EvidenceFrames | None, served_ok: np.ndarray, cached: np.ndarray,
             block: np.ndarray, previous_turn: np.ndarray, cut: np.ndarray) -> _Precise:
    """The precise-mode columns (:class:`_Precise`); ``served_ok``: attributable with a known cached count;
    ``cut``: per row, tokens beyond which no block is decided by the evidence (the fingerprints' drift,
    :func:`ingest.attribution.drift_first`)."""
    n = len(df)
    none = frames is None or frames.requests.is_empty()
    slots = 0 if none else len(_STATE_ZONES)  # no evidence: no slots (each would only be compared and dropped)
    out = _Precise(np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64),
                   (np.zeros((n, slots), dtype=np.int64), np.zeros((n, slots), dtype=np.int16),
                    np.zeros((n, slots), dtype=np.int16)), np.full(n, "", dtype=object), np.full(n, -1, np.int64))
    if none:
        return out
    key = ["request_id", "t"] if "t" in frames.requests.columns else ["request_id"]
    rows = (df.select("request_id", pl.col("ts").dt.epoch("ms").alias("t"), pl.col("p_pod").fill_null("")
                      .cast(pl.String)).with_row_index("row")
            .join(frames.requests, on=key, how="inner"))
    at = rows["row"].to_numpy().astype(np.int64)
    ok = (rows["block_size"].to_numpy() == _i(df, "block_size")[at]) & served_ok[at]
    at, rows = at[ok], rows.filter(pl.Series(ok))
    out.rows[at] = True
    out.covered[at] = rows.select(pl.col("covered").list.contains(pl.col("p_pod"))).to_series().to_numpy()
    blocks = (rows.select("row", *key).join(frames.blocks, on=key, how="inner")
              .sort("row", "i"))
    if blocks.is_empty():
        return out
    r = blocks["row"].to_numpy().astype(np.int64)
    i = blocks["i"].to_numpy().astype(np.int64)
    before_cut = (cached[r] // block[r] + i + 1) * block[r] <= cut[r]
    first = (i == 0) & before_cut
    out.pod[r[first]] = blocks["pod"].to_numpy()[first]
    out.removed_at[r[first]] = blocks["removed_at"].fill_null(-1).to_numpy()[first]
    state = blocks["state"].to_numpy()
    if "pods_down" in df.columns:  # holders the gateway found down: routed_away / pod_down (kv_evidence_zones)
        state = _held_by_down(df["pods_down"], r, blocks["pod"], state)
    stop = pl.DataFrame({"r": r, "nowhere": np.where(state == NOWHERE, i, np.iinfo(np.int64).max)}).select(
        pl.col("nowhere").min().over("r")).to_series().to_numpy()
    named = (i < stop) & before_cut
    r, i, state = r[named], i[named], state[named]
    bsz, c = block[r], cached[r]
    last = _full(_i(df, "prompt_tokens")[r] - 1, bsz)
    j = c // bsz + i
    tok = np.maximum(0, np.minimum((j + 1) * bsz, last) - np.maximum(j * bsz, c))
    end = np.minimum((j + 1) * bsz, last)
    np.maximum.at(out.start, r, end)
    code = np.zeros(len(r), dtype=np.int64)
    for k, name in enumerate(_STATE_ZONES):
        code[state == name] = k
    # per row and zone: tokens and the first block with tokens (split_missed_tokens keeps first appearance)
    agg = (pl.DataFrame({"r": r, "code": code, "tok": tok, "i": np.where(tok > 0, i, np.iinfo(np.int64).max)})
           .group_by("r", "code").agg(pl.col("tok").sum(), pl.col("i").min())
           .filter(pl.col("tok") > 0).sort("r", "i")
           .with_columns(pl.int_range(pl.len()).over("r").alias("slot")))
    ar, slot, acode = (agg[c].to_numpy().astype(np.int64) for c in ("r", "slot", "code"))
    tokens, causes, subs = out.zones
    tokens[ar, slot] = agg["tok"].to_numpy()
    names = list(_STATE_ZONES.values())
    causes[ar, slot] = np.array([_code(names[k][0]) for k in range(slots)], dtype=np.int16)[acode]
    sub = np.array([_code(names[k][1] or "") for k in range(slots)], dtype=np.int16)[acode]
    evicted_sub = np.where(previous_turn[ar], _code(EVICTED_BEFORE_NEXT_TURN), 0)
    subs[ar, slot] = np.where(acode == 0, evicted_sub, sub)
    return out


def _held_by_down(pods_down: pl.Series, r: np.ndarray, holder: pl.Series, state: np.ndarray) -> np.ndarray:
    """``state`` (per block: its state; ``r`` its row of the frame, ``holder`` its holder pod) with each block resident
    elsewhere whose holder is among its row's ``pods_down`` as :data:`_HELD_BY_DOWN`. Only the blocks resident
    elsewhere are looked at, and none when no row logged a down pod."""
    elsewhere = np.flatnonzero(state == RESIDENT_ELSEWHERE)
    pods_down = pods_down.cast(pl.List(pl.String))
    if not elsewhere.size or not (pods_down.list.len().fill_null(0) > 0).any():
        return state
    down = pl.DataFrame({"pod": holder.cast(pl.String).gather(elsewhere).fill_null(""),
                         "down": pods_down.gather(r[elsewhere])}).select(
        pl.col("down").list.contains(pl.col("pod")).fill_null(False)).to_series().to_numpy()
    held = np.zeros(len(state), dtype=bool)
    held[elsewhere[down]] = True
    return np.where(held, _HELD_BY_DOWN, state)


def _text_column(df: pl.DataFrame, column: str, where: np.ndarray | None = None) -> pa.Array:
    """A string column of ``df`` as an Arrow string array (nulls as "", as the reference gives them); with
    ``where`` (a bool per row), "" on the other rows. In polars and Arrow: no Python string per row."""
    text = pl.col(column).cast(pl.String).fill_null("")
    if where is not None:
        text = pl.when(pl.Series(where)).then(text).otherwise(pl.lit(""))
    return df.select(text).to_series().to_arrow().cast(pa.string())


def _merge(tok: np.ndarray, cause: np.ndarray, sub: np.ndarray) -> None:
    """Add each slot's tokens to the first earlier slot with tokens and the same (cause, sub_cause), in place
    (split_missed_tokens totals per pair, in order of first appearance)."""
    for k in range(1, tok.shape[1]):
        moved = np.zeros(len(tok), dtype=bool)
        for m in range(k):
            # the names (object arrays: slow to compare) only on the rows where both slots have tokens
            rows = np.flatnonzero(~moved & (tok[:, m] > 0) & (tok[:, k] > 0))
            if not rows.size:
                continue
            rows = rows[(cause[rows, m] == cause[rows, k]) & (sub[rows, m] == sub[rows, k])]
            tok[rows, m] += tok[rows, k]
            tok[rows, k] = 0
            moved[rows] = True


#: The columns :func:`chain_columns` adds: the tokens two logged block chains prove shared (−1: unknown) and
#: whether those are all the predecessor's full blocks (:func:`ingest.attribution.chain_shared`).
CHAIN_SHARED, CHAIN_COVERS = "chain_shared_tokens", "chain_covers"
_CHAIN_INPUTS = ("prompt_block_hashes", "prompt_block_size", "p_prompt_block_hashes", "p_prompt_block_size")


def chain_columns(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` (with :data:`_CHAIN_INPUTS`: each row's block chain and its predecessor's) with :data:`CHAIN_SHARED`
    (k·block_size for the k leading equal hashes; −1 when either chain is empty or the block sizes differ) and
    :data:`CHAIN_COVERS` (k is the predecessor's whole chain), as :func:`ingest.attribution.chain_shared`: the run of
    equal positions from the first (one explode of the pairs' common length, no per-row Python)."""
    n = len(df)
    size = df["prompt_block_size"].fill_null(0).cast(pl.Int64)
    pairs = pl.DataFrame({
        "row": np.arange(n), "a": df["prompt_block_hashes"], "b": df["p_prompt_block_hashes"],
        "ok": (size > 0) & (size == df["p_prompt_block_size"].fill_null(0).cast(pl.Int64)),
    }).with_columns(pl.col("a").list.len().fill_null(0).alias("la"), pl.col("b").list.len().fill_null(0).alias("lb"))
    pairs = pairs.with_columns(pl.col("ok") & (pl.col("la") > 0) & (pl.col("lb") > 0))
    m = pl.min_horizontal("la", "lb")
    common = pairs.filter(pl.col("ok")).select("row", pl.col("a").list.head(m), pl.col("b").list.head(m)).explode(
        ["a", "b"]).group_by("row").agg((pl.col("a") == pl.col("b")).cast(pl.Int64).cum_min().sum().alias("k"))
    k = np.full(n, -1, dtype=np.int64)
    k[common["row"].to_numpy()] = common["k"].to_numpy()
    lb = pairs["lb"].to_numpy()
    return df.with_columns(pl.Series(CHAIN_SHARED, np.where(k >= 0, k * size.to_numpy(), -1)),
                           pl.Series(CHAIN_COVERS, (k >= 0) & (k == lb)))


#: What :func:`judge_frame` asks of a caller that reads the chains itself: given the rows whose segments claim a drift
#: that chains could bound, a frame of :data:`CHAIN_SHARED` and :data:`CHAIN_COVERS` for every row of ``df``.
ChainReader = Callable[[np.ndarray], pl.DataFrame]


def _chain_bounded(df: pl.DataFrame, prompt: np.ndarray, s: np.ndarray, drift: np.ndarray, w: np.ndarray,
                   chains: ChainReader | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(S, drift, W) bounded by the block chains (:func:`ingest.attribution.chain_bounded`), from
    :data:`CHAIN_SHARED` and :data:`CHAIN_COVERS`: ``chains`` of the drifted rows when given, else computed by
    :func:`chain_columns` when the chains are in ``df``; unchanged otherwise."""
    claimed = (drift != 0) & (drift != _code(CACHE_SALT_CHANGED))
    if chains is None and all(c in df.columns for c in _CHAIN_INPUTS):
        chains = lambda _: chain_columns(df)  # noqa: E731
    if chains is None or not claimed.any():
        return s, drift, w
    proven = chains(claimed)
    tokens = proven[CHAIN_SHARED].fill_null(-1).to_numpy()
    covers = proven[CHAIN_COVERS].fill_null(False).to_numpy()
    bounded = (tokens >= 0) & claimed
    cap = np.minimum(prompt, _i(df, "p_prompt_tokens"))
    gone = bounded & covers
    later = bounded & ~covers & (tokens > s)
    s = np.where(gone, cap, np.where(later, tokens, s))
    w = np.where(gone, cap, np.where(later, np.maximum(w, tokens), w))
    return s, np.where(gone, 0, drift), w


def _named(df: pl.DataFrame, prompt: np.ndarray, served: np.ndarray, kind: pl.Series
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(segment offsets, has segment counts, names a predecessor, has one whose rules can be checked, that one is
    the previous turn) per row: a served request with a prompt names its predecessor (as judge: none without a
    prompt), and the rules need segment counts."""
    off, has_counts = _offsets(df, prompt)
    named = served & (prompt > 0) & (kind != "").to_numpy()
    has_pred = named & has_counts
    return off, has_counts, named, has_pred, has_pred & (kind == PREVIOUS_TURN).to_numpy()


def _judge_columns(df: pl.DataFrame, frames: EvidenceFrames | None, chains: ChainReader | None = None
                   ) -> dict[str, Any]:
    """:func:`judge_frame`, column-wise."""
    n = len(df)
    prompt, cached = _i(df, "prompt_tokens"), _i(df, "cached_tokens")
    unknown = df["cached_tokens"].is_null().to_numpy()
    block = np.maximum(_i(df, "block_size"), 1)
    served = (df["status"].fill_null(0).cast(pl.Int64).to_numpy() < 400)
    kind = df["predecessor_kind"].cast(pl.String).fill_null("")
    attributable = served & np.where(unknown, prompt > 0, prompt > cached)
    off, has_counts, named, has_pred, prev_turn = _named(df, prompt, served, kind)
    # without segment counts no predecessor rule can be checked: an attributable request then has none
    has_pred_out = named & (has_counts | ~attributable)
    s, drift, w, identical = _shared(df, prompt, off, has_pred, prev_turn)
    s, drift, w = _chain_bounded(df, prompt, s, drift, w, chains)
    beyond = (df["beyond_horizon"].fill_null(False).cast(pl.Boolean).to_numpy() if "beyond_horizon" in df.columns
              else np.zeros(len(df), dtype=bool)) & named
    same_pod = _eq(df, "pod", "p_pod")
    reuse = np.where(beyond, _code(BEYOND_HORIZON), np.where(same_pod, _code(EVICTED), _code(ROUTED_AWAY)))
    reuse_sub = np.where(~beyond & same_pod & prev_turn, _code(EVICTED_BEFORE_NEXT_TURN), 0)
    if "pods_down" in df.columns:  # the predecessor's pod was down as the request was routed (_reuse_cause)
        holder = pl.col("p_pod").cast(pl.String).fill_null("")
        holder_down = df.select(pl.col("pods_down").cast(pl.List(pl.String)).list.contains(holder).fill_null(False)
                                ).to_series().to_numpy()
        reuse_sub = np.where(~beyond & ~same_pod & holder_down, _code(POD_DOWN), reuse_sub)
    drifted = has_pred & (drift != 0)
    cut = np.where(drifted, _full(np.minimum(np.maximum(s, 0), prompt - 1), block), np.iinfo(np.int64).max)
    ev = _precise(df, frames, attributable & ~unknown, cached, block, prev_turn & ~beyond, cut)
    # precise mode: the blocks resident nowhere cannot have been left on a covered pod (_precise_reuse_cause)
    reused_codes = [_code(ROUTED_AWAY), _code(EVICTED)]
    cold = ev.rows & ev.covered & np.isin(reuse, reused_codes)
    reuse, reuse_sub = np.where(cold, _code(COLD), reuse), np.where(cold, 0, reuse_sub)
    zones = _zones(prompt, cached, block, off[:, HISTORY + 1], has_counts, has_pred, s, drift, w, identical, reuse,
                   reuse_sub, ev.start)
    over = attributable & ~unknown & (cached > _full(prompt - 1, block))
    skipped = attributable & unknown & (df["skip_reading_prefix_cache"].fill_null(False).to_numpy()
                                        if "skip_reading_prefix_cache" in df.columns else np.zeros(n, dtype=bool))
    fanned = attributable & unknown & ~skipped & (df["engine_requests"].fill_null(1).to_numpy() > 1
                                                  if "engine_requests" in df.columns else np.zeros(n, dtype=bool))
    causes, subs, tokens = _lists(zones, attributable, [(over, UNKNOWN, "", prompt - cached),
                                                        (attributable & unknown, NOT_REPORTED, "", prompt),
                                                        (skipped, NOT_REPORTED, SKIP_READING_PREFIX_CACHE, prompt),
                                                        (fanned, NOT_REPORTED, SEVERAL_ENGINE_REQUESTS, prompt)],
                                  ev.zones)
    reused = attributable & ~unknown & ~over & (zones[0][0] > 0) & np.isin(zones[0][1], reused_codes)
    ts_ms = df["ts"].dt.epoch("ms").to_numpy()
    p_ts_ms = df["p_ts"].dt.epoch("ms").fill_null(0).to_numpy()
    p_e2e = df["p_e2e_ms"].fill_null(0.0).to_numpy()
    stored_kind = pl.when(pl.Series(has_pred_out)).then(
        kind + pl.when(pl.Series(beyond)).then(pl.lit(BEYOND_HORIZON_KIND_SUFFIX)).otherwise(pl.lit(""))
    ).otherwise(pl.lit(""))
    gap = np.where(has_pred_out, (ts_ms - p_ts_ms).astype(np.float64) - p_e2e, np.nan)
    def text(values: np.ndarray) -> pa.Array:  # object or unicode numpy → Arrow strings, in C
        return pa.array(values, type=pa.string())

    return {
        "request_id": _text_column(df, "request_id"), "ts": df["ts"], "tenant_id": _text_column(df, "tenant_id"),
        "pod": _text_column(df, "pod"), "model": _text_column(df, "model"), "prompt_tokens": prompt,
        "cached_tokens": pa.array(cached, type=pa.uint32(), mask=unknown),
        "predecessor_request_id": _text_column(df, "p_request_id", has_pred_out),
        "predecessor_pod": _text_column(df, "p_pod", has_pred_out),
        "predecessor_kind": pl.select(stored_kind).to_series().to_arrow().cast(pa.string()),
        "gap_ms": pa.array(np.where(np.isnan(gap), 0.0, gap), type=pa.float64(), mask=np.isnan(gap)),
        "block_size": _i(df, "block_size"), "causes": causes, "sub_causes": subs, "missed_tokens": tokens,
        "evidence": _names(np.where(ev.rows, _code(EVIDENCE_KV_EVENTS), np.where(
            reused, _code(EVIDENCE_INFERRED), _code(EVIDENCE_FINGERPRINTS)))),
        "evidence_pod": text(np.where(ev.rows, ev.pod, "")) if ev.rows.any() else _names(np.zeros(n, np.int16)),
        "evidence_removed_at": pa.array(np.maximum(ev.removed_at, 0), type=pa.timestamp("ms", tz="UTC"),
                                        mask=~ev.rows | (ev.removed_at < 0)),
    }
