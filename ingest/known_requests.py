"""The predecessor fields of a run's recent arrivals, kept so that a chunk's predecessors are gathered, not read
again (ingest/attribution_job.py).

Most predecessors are recent: a conversation's next turn comes seconds to minutes later, and a predecessor lies
within the horizon (an hour by default). The job judges a chunk with each target's chosen predecessor's fields
(:data:`ingest.attribution_batch.PREDECESSOR_FIELDS`), which it read when the predecessor arrived in this run.
:class:`KnownRequests` keeps them, one part per chunk of arrivals, with the chunk's names (order_key, id_hash)
sorted: a run's chunks cover ascending, disjoint order_key ranges, so the parts' sorted names laid end to end are
sorted too, and a chunk finds its predecessors by binary search (numpy ``searchsorted``), then gathers their rows
part by part. Each part is one contiguous polars chunk: a gather from a frame of several chunks (as a query or a
concatenation returns it) cost 8 times as much (0.67 against 0.08 CPU-s for 4.5·10^5 rows).

Before, the job kept ~6·10^5 rows and filtered each kept frame for the wanted order_keys (``is_in``), and read older
predecessors back from ``gateway_requests`` (sorted by tenant: each in its own granule): at 10^7 requests of
generated history that read cost 14 of the run's ~150 CPU-s.

Parts whose latest arrival is older than the horizon before the chunk are dropped (no predecessor within the
horizon lies there), and at most ``max_rows`` rows are kept (the oldest parts dropped first, the newest always
kept); the caller reads the predecessors not kept from the store.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from ingest.key_tails import ID_HASH


def names(frame: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order_keys, id_hashes, rows) of ``frame`` sorted by (order_key, id_hash): uint64, uint64 and int64 arrays
    of ``len(frame)``, ``rows`` giving each name's row. One argsort of the order_keys, and of both columns only
    when two rows share an order_key (two ids of one millisecond with the same 20 MD5 bits, sql/migrations/0008)."""
    keys = frame["order_key"].cast(pl.UInt64).to_numpy()
    hashes = frame[ID_HASH].cast(pl.UInt64).to_numpy()
    rows = np.argsort(keys, kind="stable")
    if len(rows) > 1 and (keys[rows[1:]] == keys[rows[:-1]]).any():
        rows = np.lexsort((hashes, keys))
    return keys[rows], hashes[rows], rows.astype(np.int64)


def positions(order_keys: np.ndarray, id_hashes: np.ndarray, want_keys: np.ndarray, want_hashes: np.ndarray
              ) -> np.ndarray:
    """Per wanted (order_key, id_hash): the index of the first row of (``order_keys``, ``id_hashes``) (sorted by
    both, ascending; uint64 arrays) that equals it, or -1. Shapes: (n,) and (m,) in, (m,) int64 out. The wanted
    keys are searched in sorted order: numpy's binary search starts each key from the last one's bounds when the
    keys ascend (5·10^5 keys in 2.5·10^6: 0.02 CPU-s sorted, 0.54 not)."""
    order = np.argsort(want_keys)
    lo, hi = np.empty(len(want_keys), dtype=np.int64), np.empty(len(want_keys), dtype=np.int64)
    lo[order] = np.searchsorted(order_keys, want_keys[order], side="left")
    hi[order] = np.searchsorted(order_keys, want_keys[order], side="right")
    out = np.full(len(want_keys), -1, dtype=np.int64)
    one = hi - lo == 1  # an order_key held once: all but a collision
    at = lo[one]
    out[one] = np.where(id_hashes[at] == want_hashes[one], at, -1)
    for k in np.flatnonzero(hi - lo > 1):  # rare: search the equal order_keys by id_hash
        j = lo[k] + np.searchsorted(id_hashes[lo[k]:hi[k]], want_hashes[k], side="left")
        if j < hi[k] and id_hashes[j] == want_hashes[k]:
            out[k] = j
    return out


def gather(parts: Sequence[pl.DataFrame], rows: np.ndarray) -> pl.DataFrame:
    """The rows ``rows`` (int64 indices into ``parts`` laid end to end; -1 = a row of nulls) of ``parts`` (frames
    of the same columns), in that order: gathered part by part, each from its own rows."""
    starts = np.cumsum([0, *(len(p) for p in parts)])
    part = np.searchsorted(starts, rows, side="right") - 1  # -1 for rows < 0
    order = np.argsort(part, kind="stable")
    pieces = []
    for k, p in enumerate(parts):
        at = order[np.searchsorted(part[order], k, side="left"):np.searchsorted(part[order], k, side="right")]
        if at.size:
            pieces.append(p[pl.Series(rows[at] - starts[k], dtype=pl.UInt64)])
    kept = order[part[order] >= 0]  # the rows found, in the order of the pieces
    lined = np.full(len(rows), -1, dtype=np.int64)
    lined[kept] = np.arange(len(kept))
    frame = pl.concat(pieces, how="vertical_relaxed", rechunk=True) if pieces else parts[0].clear()
    index = pl.Series(np.maximum(lined, 0), dtype=pl.UInt64).scatter(np.flatnonzero(lined < 0), None)
    return frame[index] if len(frame) else frame.clear(len(rows))


class KnownRequests:
    """The ``columns`` (order_key and :data:`ID_HASH` among them) of a run's last chunks of arrivals. :meth:`add`
    each chunk in ascending order_key order (a chunk that is not after the last one starts the parts again);
    :meth:`find` gives the rows of names, :meth:`gather` those rows."""

    def __init__(self, columns: Sequence[str], max_rows: int) -> None:
        self.columns = list(columns)
        self.max_rows = max_rows
        self.parts: list[pl.DataFrame] = []
        self._names: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per part: names()
        self._latest: list[int] = []  # per part, its latest ts (unix ms)
        self._keys = self._hashes = np.empty(0, dtype=np.uint64)
        self._rows = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, arrivals: pl.DataFrame, horizon_start_ms: int | None = None) -> None:
        """Keep ``arrivals``' columns; drop the parts whose latest ts (unix ms) is before ``horizon_start_ms``
        (no predecessor within the horizon of the chunks to come lies there), then the oldest while more than
        ``max_rows`` rows are kept (the newest part is always kept)."""
        if arrivals.is_empty():
            return
        part = arrivals.select(self.columns).rechunk()
        named = names(part)
        if self.parts and named[0][0] <= self._keys[-1]:
            self.parts, self._names, self._latest = [], [], []
        self.parts.append(part)
        self._names.append(named)
        self._latest.append(int(part.select(pl.col("ts").max().dt.epoch("ms")).item()))
        while len(self.parts) > 1 and (
                (horizon_start_ms is not None and self._latest[0] < horizon_start_ms)
                or sum(len(p) for p in self.parts) > self.max_rows):
            for kept in (self.parts, self._names, self._latest):
                kept.pop(0)
        starts = np.cumsum([0, *(len(p) for p in self.parts)])
        self._keys = np.concatenate([n[0] for n in self._names])
        self._hashes = np.concatenate([n[1] for n in self._names])
        self._rows = np.concatenate([n[2] + start for n, start in zip(self._names, starts, strict=False)])

    def find(self, want_keys: np.ndarray, want_hashes: np.ndarray) -> np.ndarray:
        """Per wanted name (uint64 arrays): its row in the kept parts laid end to end, or -1."""
        at = positions(self._keys, self._hashes, want_keys, want_hashes)
        return np.where(at >= 0, self._rows[np.maximum(at, 0)], -1) if len(self) else at

    def gather(self, rows: np.ndarray) -> pl.DataFrame:
        """:func:`gather` from the kept parts (rows from :meth:`find`)."""
        return gather(self.parts, rows) if self.parts else pl.DataFrame(
            schema={c: pl.Null for c in self.columns}).clear(len(rows))
