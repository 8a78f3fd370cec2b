"""The column-wise attribution (ingest/attribution_batch.py) gives, for every request of random traffic, the
same verdict as the readable per-request reference (ingest/attribution.py judge)."""

from __future__ import annotations

import polars as pl
import pytest
from test_attribution import random_requests

from ingest import attribution as a
from ingest.attribution_batch import judge_frame


@pytest.mark.parametrize("seed", range(4))
def test_column_wise_verdicts_equal_the_reference(seed: int) -> None:
    reqs = random_requests(600, seed)
    index = a.PredecessorIndex(reqs)
    sizes = {"pod-a": 32, "pod-b": 16, "pod-c": 64}
    rows, expected = [], []
    for r in reqs:
        pred = index.find(r)
        size = a.block_size_for(r, sizes, 16)
        expected.append(a.judge(r, pred, size).values())
        p = pred.request if pred else {}
        rows.append({**{f: r.get(f) for f in a.REQUEST_FIELDS}, "block_size": size,
                     "predecessor_kind": pred.kind if pred else "",
                     **{f"p_{f}": p.get(f) for f in a.REQUEST_FIELDS}})
    got = judge_frame(pl.DataFrame(rows, infer_schema_length=None))
    got = {c: v.to_pylist() if hasattr(v, "to_pylist") else v for c, v in got.items()}
    columns = a.VERDICT_COLUMNS
    for k, want in enumerate(expected):
        have = tuple(got[c][k] for c in columns)
        have = tuple(tuple(v) if isinstance(v, list) else v for v in have)
        want = tuple(want)
        assert have[:1] + have[2:] == want[:1] + want[2:], (k, dict(zip(columns, have, strict=True)),
                                                            dict(zip(columns, want, strict=True)))
