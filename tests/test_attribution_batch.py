"""The column-wise attribution (ingest/attribution_batch.py) gives, for every request of random traffic, the
same verdict as the readable per-request reference (ingest/attribution.py judge)."""

from __future__ import annotations

import random
from typing import Any

import polars as pl
import pytest
from test_attribution import req

from ingest import attribution as a
from ingest.attribution_batch import judge_frame


def random_requests(n: int, seed: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rnd.randint(0, 3000)
        seg = [rnd.choice([0, rnd.randint(1, 900)]) for _ in range(5)]
        out.append(req(
            f"r{i:04d}", at=round(rnd.uniform(0, 5000), 3), tenant=rnd.choice("ab"), conv=rnd.choice(["", "c1", "c2"]),
            run=rnd.choice(["", "x"]), pod=rnd.choice(["pod-a", "pod-b", "pod-c"]), prompt=prompt,
            cached=rnd.choice([0, rnd.randint(0, prompt + 50)]), status=rnd.choice([200, 200, 200, 500]),
            system=rnd.choice(["", "s1", "s2"]), system_norm=rnd.choice([None, "n"]), system_tokens=seg[0],
            tools=rnd.choice(["", "t1", "t2"]), tools_canonical=rnd.choice([None, "tc"]), tools_tokens=seg[1],
            rag=rnd.choice(["", "r1", "r2"]), rag_set=rnd.choice([None, "rs"]), rag_tokens=seg[2],
            history=rnd.choice(["", "h1", "h2"]), prev_history=rnd.choice(["", "h1"]), history_tokens=seg[3],
            suffix=rnd.choice(["", "x1", "x2"]), suffix_tokens=seg[4],
        ))
    return out


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
