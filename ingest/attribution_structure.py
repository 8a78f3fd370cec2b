"""The structural rules of attribution over whole columns (the batch path's half of
:func:`ingest.attribution.first_changed_line_tokens`, :func:`ingest.attribution.lines_volatile` and
:func:`ingest.attribution.suffix_chunk_drift`): the per-line hashes of the system prompt and the per-chunk
hashes of the suffix are list columns; they are exploded into one row per (request, position), compared by
joins, and aggregated back per request, so no Python runs per request.

Input: the frame of :mod:`ingest.attribution_batch` (a row per target, its predecessor's fields prefixed ``p_``).
The list columns may be absent (read as empty), hold hex strings (tests) or UInt64 (the store): hashes are
compared as strings. A hash list and its token list have the same length (collector/gateway_record.py checks it).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from ingest.attribution import (
    CHUNK_HASHES,
    CHUNK_TOKENS,
    LINE_HASHES,
    LINE_TOKENS,
    MIN_HEAD_TOKENS,
    MIN_STRUCTURE_LINES,
    RAG_CHANGED,
    RAG_REORDERED,
    VOLATILE_LINE_SHARE,
)


def _column(df: pl.DataFrame, col: str, dtype: pl.DataType) -> pl.Series:
    """A list column cast to List(dtype), nulls as empty lists; all empty when the frame lacks it."""
    if col not in df.columns:
        return pl.Series(col, [[] for _ in range(len(df))], dtype=pl.List(dtype))
    return df[col].cast(pl.List(dtype)).fill_null(pl.Series([[]], dtype=pl.List(dtype)))


def _long(hashes: pl.Series, tokens: pl.Series | None = None) -> pl.DataFrame:
    """One row per (row, pos) of the lists: columns row, pos, h (and t with ``tokens``)."""
    cols = {"row": np.arange(len(hashes)), "h": hashes}
    if tokens is not None:
        cols["t"] = tokens
    frame = pl.DataFrame(cols).explode(["h", "t"] if tokens is not None else ["h"]).filter(pl.col("h").is_not_null())
    return frame.with_columns(pl.int_range(pl.len()).over("row").alias("pos"))


def _per_row(n: int, frame: pl.DataFrame, col: str, default: int) -> np.ndarray:
    """``frame[col]`` scattered to an array of ``n`` rows by ``frame["row"]``; ``default`` elsewhere (and for
    nulls)."""
    out = np.full(n, default, dtype=np.int64)
    if not frame.is_empty():
        values = frame[col].fill_null(default).cast(pl.Int64).to_numpy()
        out[frame["row"].to_numpy()] = values
    return out


def _compare(df: pl.DataFrame, hashes: str, tokens: str) -> tuple[pl.DataFrame, pl.DataFrame, np.ndarray,
                                                                   np.ndarray, np.ndarray]:
    """(this side exploded with ``neq`` per position and ``first``, the first differing position of its row,
    the predecessor's side exploded, lengths here, lengths there, first per row)."""
    n = len(df)
    a = _column(df, hashes, pl.String)
    b = _column(df, "p_" + hashes, pl.String)
    la = a.list.len().to_numpy().astype(np.int64)
    lb = b.list.len().to_numpy().astype(np.int64)
    this = _long(a, _column(df, tokens, pl.Int64))
    pred = _long(b)
    joined = this.join(pred.rename({"h": "ph"}), on=["row", "pos"], how="left").with_columns(
        (pl.col("ph").is_null() | (pl.col("h") != pl.col("ph"))).alias("neq"))
    firsts = joined.group_by("row").agg(pl.col("pos").filter(pl.col("neq")).min().alias("first"),
                                        pl.col("neq").sum().alias("ndiff"))
    first = _per_row(n, firsts.filter(pl.col("first").is_not_null()), "first", -1)
    first = np.where(first < 0, np.minimum(la, lb), first)
    joined = joined.with_columns(pl.Series("first", first)[joined["row"].to_numpy()].alias("first"))
    ndiff = _per_row(n, firsts, "ndiff", 0)
    return joined, pred, la, lb, np.stack([first, ndiff])


def _sum_where(n: int, frame: pl.DataFrame, cond: pl.Expr) -> np.ndarray:
    """Σ t per row over the positions where ``cond`` holds (0 elsewhere)."""
    return _per_row(n, frame.filter(cond).group_by("row").agg(pl.col("t").sum()), "t", 0)


def system_lines(df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(raw tokens before the first changed system line, volatile by structure) per row: the column-wise
    :func:`ingest.attribution.first_changed_line_tokens` and :func:`ingest.attribution.lines_volatile`."""
    n = len(df)
    joined, _, la, lb, (first, ndiff) = _compare(df, LINE_HASHES, LINE_TOKENS)
    before = _sum_where(n, joined, pl.col("pos") < pl.col("first"))
    system = np.maximum(df["system_tokens"].fill_null(0).cast(pl.Int64).to_numpy(), 0)
    none = (la == 0) | (lb == 0) | ((first == la) & (la == lb))
    at = np.where(none, 0, np.minimum(before, system))
    allowed = np.maximum(1, np.floor(la * VOLATILE_LINE_SHARE).astype(np.int64))
    volatile = (la == lb) & (la >= MIN_STRUCTURE_LINES) & (ndiff >= 1) & (ndiff <= allowed)
    return at, volatile


def suffix_chunks(df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shared raw suffix tokens, drift sub-cause or "", raw end of the drift) per row: the column-wise
    :func:`ingest.attribution.suffix_chunk_drift`."""
    n = len(df)
    joined, pred, la, lb, (k, _) = _compare(df, CHUNK_HASHES, CHUNK_TOKENS)
    shared = _sum_where(n, joined, pl.col("pos") < pl.col("first"))
    had = pred.select("row", "h").unique().with_columns(pl.lit(True).alias("known"))
    joined = joined.join(had, on=["row", "h"], how="left").with_columns(pl.col("known").fill_null(False))
    last = pl.Series("last", la - 1)[joined["row"].to_numpy()]
    joined = joined.with_columns(last.alias("last"))
    j = _per_row(n, joined.filter(pl.col("known") & (pl.col("pos") >= pl.col("first"))
                                  & (pl.col("pos") < pl.col("last"))).group_by("row").agg(pl.col("pos").max()),
                 "pos", -1)
    joined = joined.with_columns(pl.Series("j", j)[joined["row"].to_numpy()].alias("j"))
    window = (pl.col("pos") >= pl.col("first")) & (pl.col("pos") <= pl.col("j"))
    known = joined.filter(window & pl.col("known")).group_by("row").agg(pl.col("t").sum(), pl.col("t").max()
                                                                       .alias("largest"))
    known_tokens, largest_known = _per_row(n, known, "t", 0), _per_row(n, known, "largest", 0)
    window_tokens = _sum_where(n, joined, window)
    end = _sum_where(n, joined, pl.col("pos") <= pl.col("j"))
    # the predecessor's chunks after the common prefix but its final one, as a set, against h[k..j] as a set
    p_rows = pred["row"].to_numpy()
    theirs = (pred.filter((pl.col("pos") >= pl.Series(k)[p_rows]) & (pl.col("pos") < pl.Series(lb - 1)[p_rows]))
              .select("row", "h").unique())
    ours = joined.filter(window).select("row", "h").unique()
    common = ours.join(theirs, on=["row", "h"], how="semi")
    count = {name: _per_row(n, frame.group_by("row").len(), "len", 0)
             for name, frame in (("ours", ours), ("theirs", theirs), ("common", common))}
    same_set = (count["ours"] == count["theirs"]) & (count["common"] == count["ours"])
    drift = (j >= 0) & (2 * known_tokens >= window_tokens) & (largest_known >= MIN_HEAD_TOKENS)
    sub = np.where(drift, np.where(same_set, RAG_REORDERED, RAG_CHANGED), "").astype(object)
    return shared, sub, np.where(drift, end, shared)


def lines_match(df: pl.DataFrame) -> np.ndarray:
    """Per row, whether a banded-key candidate is confirmed by the lines: the column-wise
    :func:`ingest.attribution.lines_match` (same line count ≥ MIN_STRUCTURE_LINES, at most the allowed share
    of lines differ, none included). Reads system_line_hashes, system_line_tokens and p_system_line_hashes."""
    _, _, la, lb, (_, ndiff) = _compare(df, LINE_HASHES, LINE_TOKENS)
    allowed = np.maximum(1, np.floor(la * VOLATILE_LINE_SHARE).astype(np.int64))
    return (la == lb) & (la >= MIN_STRUCTURE_LINES) & (ndiff <= allowed)


def system_documents(df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(drift sub-cause or "", raw end of the drift in system tokens, new lines after it, the head alone) per row:
    the column-wise :func:`ingest.attribution.system_document_drift` (retrieved documents in the system prompt after
    an unchanged instruction head; a blank line is a line of 0 tokens), and the equality of the two prompts'
    :func:`ingest.attribution.system_head` (the lines before the first blank line, neither the first nor the last
    line on either side, of at least MIN_HEAD_TOKENS tokens, all before the first differing line) with no non-blank
    line after it that the predecessor had (the parts of :func:`ingest.attribution.head_only` read from the lines)."""
    n = len(df)
    joined, pred, la, lb, (k, _) = _compare(df, LINE_HASHES, LINE_TOKENS)
    rows = joined["row"].to_numpy()
    first_blank = _per_row(n, joined.filter(pl.col("t") == 0).group_by("row").agg(pl.col("pos").min()), "pos", -1)
    head_tokens = _sum_where(n, joined.with_columns(pl.Series("fb", first_blank)[rows].alias("fb")),
                             pl.col("pos") < pl.col("fb"))
    same_head = ((first_blank >= 1) & (first_blank < k) & (first_blank < la - 1) & (first_blank < lb - 1)
                 & (head_tokens >= MIN_HEAD_TOKENS))
    head_blank = _per_row(n, joined.filter(pl.col("pos") == pl.col("first") - 1).with_columns(
        (pl.col("t") == 0).cast(pl.Int64).alias("blank")), "blank", 0) == 1
    para_end = _per_row(n, joined.filter((pl.col("pos") >= pl.col("first")) & (pl.col("t") == 0))
                        .group_by("row").agg(pl.col("pos").min()), "pos", -1)
    para_end = np.where(para_end < 0, la, para_end)
    joined = joined.with_columns(pl.Series("para_end", para_end)[rows].alias("para_end"))
    kept = _per_row(n, joined.filter((pl.col("pos") >= pl.col("first")) & (pl.col("pos") < pl.col("para_end"))
                                     & ~pl.col("neq")).group_by("row").len(), "len", 0)
    had = pred.select("row", "h").unique().with_columns(pl.lit(True).alias("known"))
    joined = joined.join(had, on=["row", "h"], how="left").with_columns(
        (pl.col("known").fill_null(False) & (pl.col("t") > 0)).alias("known"))
    j = _per_row(n, joined.filter(pl.col("known") & (pl.col("pos") >= pl.col("first")))
                 .group_by("row").agg(pl.col("pos").max()), "pos", -1)
    # a known line elsewhere than in the predecessor: documents moved (paragraphs replaced in place are not)
    moved = _per_row(n, joined.filter(pl.col("known") & (pl.col("pos") >= pl.col("first")) & pl.col("neq"))
                     .group_by("row").len(), "len", 0) > 0
    # a line after the head that the predecessor had: not found on the head alone (ingest.attribution.head_only)
    known_after_head = _per_row(n, joined.filter(pl.col("known") & (pl.col("pos") > pl.Series(first_blank)[rows]))
                                .group_by("row").len(), "len", 0) > 0
    joined = joined.with_columns(pl.Series("j", j)[rows].alias("j"))
    window = (pl.col("pos") >= pl.col("first")) & (pl.col("pos") <= pl.col("j"))
    known = joined.filter(window & pl.col("known")).group_by("row").agg(pl.col("t").sum(),
                                                                       pl.col("t").max().alias("largest"))
    known_tokens, largest_known = _per_row(n, known, "t", 0), _per_row(n, known, "largest", 0)
    window_tokens = _sum_where(n, joined, window)
    new_tokens = window_tokens - known_tokens  # blank lines hold 0 tokens
    end = _sum_where(n, joined, pl.col("pos") <= pl.col("j"))
    new_after = _per_row(n, joined.filter((pl.col("pos") > pl.col("j")) & (pl.col("t") > 0) & ~pl.col("known"))
                         .group_by("row").len(), "len", 0) > 0
    # the non-blank lines of a[k..j] against the predecessor's lines from k on (this request's blank lines left out)
    blank = joined.filter(pl.col("t") == 0).select("row", "h").unique()
    p_rows = pred["row"].to_numpy()
    theirs = (pred.filter(pl.col("pos") >= pl.Series(k)[p_rows]).select("row", "h").unique()
              .join(blank, on=["row", "h"], how="anti"))
    ours = joined.filter(window & (pl.col("t") > 0)).select("row", "h").unique()
    common = ours.join(theirs, on=["row", "h"], how="semi")
    count = {name: _per_row(n, frame.group_by("row").len(), "len", 0)
             for name, frame in (("ours", ours), ("theirs", theirs), ("common", common))}
    same_set = (count["ours"] == count["theirs"]) & (count["common"] == count["ours"])
    drift = ((la > 0) & (lb > 0) & (k >= 1) & (k < la) & head_blank & (kept == 0) & (j >= 0) & moved
             & (2 * known_tokens >= window_tokens) & (largest_known >= MIN_HEAD_TOKENS)
             & ((new_tokens == 0) | (new_tokens >= MIN_HEAD_TOKENS)))
    sub = np.where(drift, np.where(same_set, RAG_REORDERED, RAG_CHANGED), "").astype(object)
    return sub, np.where(drift, end, 0), drift & new_after, same_head & ~known_after_head
