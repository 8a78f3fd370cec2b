"""Workload labels (ingest/labels.py, `kvscope import labels`, migration workload_labels) and the named query
attribution_agreement: the label contract, exactly-once loading, dead letters, and agreement figures derived
by hand from tests/fixture_data.py (LABELS against ATTRIBUTION)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from demo.workload import PATHOLOGIES
from ingest import attribution as a
from ingest.labels import PATHOLOGY_CAUSES, BadLabel, LabelTail, load_labels, parse_label
from ingest.store import Store
from kvscope.cli import main
from tests.clock import DAY
from tests.fixture_data import ATTRIBUTION_COLUMNS, GATEWAY_COLUMNS, at, gateway_rows, load_fixture


@pytest.fixture(scope="module")
def fx(chdb_dir: Path) -> Store:
    s = Store.open(data_dir=chdb_dir, database=f"lb_{uuid.uuid4().hex[:12]}")
    s.migrate()
    load_fixture(s)
    return s


def agreement(store: Store, **params: Any) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    rows = store.named("attribution_agreement", {k: str(v) for k, v in params.items()}).to_dicts()
    return {(r["intended_cause"], r["intended_sub_cause"], r["attributed_cause"], r["attributed_sub_cause"]): r
            for r in rows}


def figures(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["requests"], row["labelled"], row["attributed"], row["precision"], row["recall"],
            row["tokens_checked"], row["tokens_exact"])


# -- vocabulary --------------------------------------------------------------------------------------------------
def test_every_workload_pathology_maps_to_a_cause() -> None:
    assert set(PATHOLOGY_CAUSES) == set(PATHOLOGIES)
    for cause, sub in PATHOLOGY_CAUSES.values():
        assert cause == "none" or (cause == a.PREFIX_DRIFT and sub in a.DRIFT_SUB_CAUSES)
    assert PATHOLOGY_CAUSES["volatile_system"] == ("prefix_drift", "volatile_system")


def test_a_workload_line_parses_with_its_mapped_cause() -> None:
    line = json.dumps({"request_id": "0101-hooli-c0-t3", "tenant_id": "hooli", "conversation_id": "x", "turn": 3,
                       "pathology": "history_truncated", "scenario": "history_truncated", "tool_wait_ms": None,
                       "ts": "2026-11-29T13:00:00.123+01:00", "run_id": "0101", "status": "ok"})
    row = parse_label(line, run_id="ignored")
    assert (row["cause"], row["sub_cause"], row["scenario"], row["run_id"]) == \
        ("prefix_drift", "history_truncated", "history_truncated", "0101")  # fmt: skip
    assert row["ts"] == datetime(2026, 11, 29, 12, 0, 0, 123000, tzinfo=UTC)
    bare = parse_label('{"request_id": "r1", "pathology": "none"}', run_id="file-run")
    assert (bare["cause"], bare["scenario"], bare["run_id"], bare["ts"], bare["tenant_id"]) == \
        ("none", "none", "file-run", None, "")  # fmt: skip


def test_an_explicit_cause_and_its_expected_split_are_normalized() -> None:
    row = parse_label(json.dumps({"request_id": "r", "cause": "routed_away", "expected_tokens": [
        {"cause": "unavoidable", "tokens": 10}, {"cause": "routed_away", "tokens": 700},
        {"cause": "unavoidable", "sub_cause": "", "tokens": 6}, {"cause": "cold", "tokens": 0}]}))
    assert (row["cause"], row["sub_cause"], row["scenario"]) == ("routed_away", "", "routed_away")
    # duplicates summed, zero entries dropped, sorted by (cause, sub_cause): the form the query compares
    assert (row["expected_causes"], row["expected_sub_causes"], row["expected_tokens"]) == \
        (["routed_away", "unavoidable"], ["", ""], [700, 16])  # fmt: skip


@pytest.mark.parametrize(("line", "reason"), [
    ("not json", "not JSON"),
    ("[1, 2]", "line is JSON list, not an object"),
    ('{"pathology": "none"}', "field request_id: missing or not a non-empty string"),
    ('{"request_id": "", "pathology": "none"}', "field request_id: missing or not a non-empty string"),
    ('{"request_id": "r"}', "no cause, and pathology '' is not one kvscope maps"),
    ('{"request_id": "r", "pathology": "slow_disk"}', "pathology 'slow_disk' is not one kvscope maps"),
    ('{"request_id": "r", "cause": "flaky"}', "cause 'flaky' is not a miss cause"),
    ('{"request_id": "r", "cause": "unavoidable"}', "cause unavoidable cannot be intended"),
    ('{"request_id": "r", "cause": "none", "sub_cause": "x"}', "cause none takes no sub_cause"),
    ('{"request_id": "r", "cause": "prefix_drift"}', "prefix_drift needs a sub_cause"),
    ('{"request_id": "r", "cause": "cold", "ts": "2026-11-29 12:00:00"}', "field ts: not an ISO 8601 time with a "
                                                                          "time zone"),
    ('{"request_id": "r", "cause": "cold", "ts": "1999-12-31T23:00:00Z"}', "outside 2000..2100"),
    ('{"request_id": "r", "cause": "cold", "ts": 1764417600}', "field ts: not an ISO 8601 time"),
    ('{"request_id": "r", "cause": "cold", "tenant_id": 7}', "field tenant_id: not a string"),
    ('{"request_id": "r", "cause": "cold", "expected_tokens": {"cold": 3}}', "field expected_tokens: not a list"),
    ('{"request_id": "r", "cause": "cold", "expected_tokens": [{"cause": "cold", "tokens": -1}]}',
     "tokens of cold must be an integer"),
    ('{"request_id": "r", "cause": "cold", "expected_tokens": [{"cause": "cold", "tokens": 1.5}]}',
     "tokens of cold must be an integer"),
])  # fmt: skip
def test_a_bad_line_is_refused_with_its_reason(line: str, reason: str) -> None:
    with pytest.raises(BadLabel, match=None) as err:
        parse_label(line)
    assert reason in str(err.value)


# -- agreement on the fixture --------------------------------------------------------------------------------------
# Evaluated: the 10 labelled requests the gateway served and attribution answered (acme-c1-err failed, ghost-1 was
# never logged, cap-5-below-one-block has no label). Intended → dominant attributed (ATTRIBUTION, unavoidable
# aside; only-unavoidable answers are none):
#   cold → cold: cap-1-cold (736), initech-c1-t1 (384)       none → none: cap-2-warm, acme-c1-t4
#   none → routed_away: acme-c1-t3 (768)                     drift/tools_reordered → same: cap-3 (64)
#   drift/volatile_system → same: cap-4 (768)                drift/rag_reordered → none: initech-c1-t2
#   drift/history_truncated → none: globex-run1-s3           below_block → below_block: initech-oneshot-2
# Expected splits: cap-1 (cold 736, unavoidable 30: the answer has 26, not exact), cap-3, cap-4 and
# initech-oneshot-2 (exact). cap-1's cancelled stale answer (cold 700) must not count.
def test_agreement_per_class_and_micro_totals(fx: Store) -> None:
    r = agreement(fx)
    # (matched, labelled, attributed, precision, recall, tokens_checked, tokens_exact)
    assert figures(r[("cold", "", "cold", "")]) == (2, 2, 2, 1.0, 1.0, 1, 0)
    assert figures(r[("none", "", "none", "")]) == (2, 3, 4, 2 / 4, 2 / 3, 0, 0)
    assert figures(r[("routed_away", "", "routed_away", "")]) == (0, 0, 1, 0.0, None, 0, 0)
    drift = "prefix_drift"
    assert figures(r[(drift, "tools_reordered", drift, "tools_reordered")]) == (1, 1, 1, 1.0, 1.0, 1, 1)
    assert figures(r[(drift, "volatile_system", drift, "volatile_system")]) == (1, 1, 1, 1.0, 1.0, 1, 1)
    assert figures(r[(drift, "rag_reordered", drift, "rag_reordered")]) == (0, 1, 0, None, 0.0, 0, 0)
    assert figures(r[(drift, "history_truncated", drift, "history_truncated")]) == (0, 1, 0, None, 0.0, 0, 0)
    assert figures(r[("below_block", "", "below_block", "")]) == (1, 1, 1, 1.0, 1.0, 1, 1)
    # micro over every class but none: matched 2+1+1+1, labelled 2+1+1+1+1+1, attributed 2+1+1+1+1 (routed_away)
    assert figures(r[("all", "", "all", "")]) == (5, 7, 6, pytest.approx(5 / 6), pytest.approx(5 / 7), 4, 3)
    assert len(r) == 9
    assert list(r)[-1] == ("all", "", "all", "")  # the total row comes last


def test_agreement_by_cause_pools_sub_causes(fx: Store) -> None:
    r = agreement(fx, by_sub_cause=0)
    assert figures(r[("prefix_drift", "", "prefix_drift", "")]) == (2, 4, 2, 1.0, 0.5, 2, 2)
    assert figures(r[("none", "", "none", "")]) == (2, 3, 4, 0.5, pytest.approx(2 / 3), 0, 0)
    assert figures(r[("all", "", "all", "")])[:3] == (5, 7, 6)
    assert {k[0] for k in r} == {"cold", "none", "prefix_drift", "routed_away", "below_block", "all"}


def test_confusion_counts_every_pair(fx: Store) -> None:
    r = agreement(fx, confusion=1)
    cells = {k: v["requests"] for k, v in r.items()}
    drift = "prefix_drift"
    assert cells == {
        ("cold", "", "cold", ""): 2, ("none", "", "none", ""): 2, ("none", "", "routed_away", ""): 1,
        (drift, "tools_reordered", drift, "tools_reordered"): 1,
        (drift, "volatile_system", drift, "volatile_system"): 1,
        (drift, "rag_reordered", "none", ""): 1, (drift, "history_truncated", "none", ""): 1,
        ("below_block", "", "below_block", ""): 1,
    }  # fmt: skip
    assert sum(cells.values()) == 10
    # off the diagonal: share of the intended class (recall) and of the attributed class (precision)
    assert figures(r[("none", "", "routed_away", "")]) == (1, 3, 1, 1.0, pytest.approx(1 / 3), 0, 0)
    assert figures(r[(drift, "rag_reordered", "none", "")]) == (1, 1, 4, 0.25, 1.0, 0, 0)


def test_agreement_filters(fx: Store) -> None:
    r = agreement(fx, run_id="run-b")  # initech: cold → cold, rag_reordered → none, below_block → below_block
    assert figures(r[("all", "", "all", "")])[:5] == (2, 3, 2, 1.0, pytest.approx(2 / 3))
    assert figures(r[("none", "", "none", "")])[:3] == (0, 0, 1)
    r = agreement(fx, tenant="globex")  # cap-3, cap-4 matched; globex-run1-s3 history_truncated → none
    assert figures(r[("all", "", "all", "")])[:3] == (2, 3, 2)
    r = agreement(fx, scenario="volatile_system")
    assert list(r) == [("prefix_drift", "volatile_system", "prefix_drift", "volatile_system"), ("all", "", "all", "")]
    r = agreement(fx, since=at(100).isoformat(), until=at(140).isoformat())  # acme-c1-t3, acme-c1-t4, oneshot-2
    assert figures(r[("all", "", "all", "")])[:3] == (1, 1, 2)
    assert agreement(fx, run_id="no-such-run") == {}


def test_dominant_cause_ties_go_to_the_first_class_alphabetically(store: Store, tmp_path: Path) -> None:
    """One request missed 64 tokens to routed_away and 64 to prefix_drift / tools_changed (and 100 unavoidable,
    which never dominates): the tie goes to prefix_drift."""
    row = next(r for r in gateway_rows() if r[0] == "acme-c1-t4")
    store.insert("gateway_requests", [("tie-1", *row[1:])], GATEWAY_COLUMNS)
    store.insert("request_attribution", [(
        "tie-1", row[1], "acme", "pod-b", "tiny", 832, 604, "acme-c1-t3", "pod-a", "previous_turn", 10.0, 32,
        ["routed_away", "prefix_drift", "unavoidable"], ["", "tools_changed", ""], [64, 64, 100], row[1], 1, 1,
    )], ATTRIBUTION_COLUMNS)  # fmt: skip
    label = {"request_id": "tie-1", "cause": "prefix_drift", "sub_cause": "tools_changed", "ts": f"{DAY}T12:02:10Z"}
    path = write_labels(tmp_path, [label])
    assert load_labels(store, path).rows == 1
    assert list(agreement(store, confusion=1)) == [("prefix_drift", "tools_changed", "prefix_drift", "tools_changed")]


def write_labels(directory: Path, labels: list[Any], name: str = "labels.jsonl") -> Path:
    """A label file of ``labels`` (dicts as JSON, strings as they are), one per line."""
    path = directory / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in labels))
    return path


# -- loading -------------------------------------------------------------------------------------------------------
def cli(store: Store, *args: str) -> tuple[int, str, str]:
    data_dir = store.dsn.removeprefix("chdb://")
    result = CliRunner().invoke(main, [*args, "--data-dir", data_dir, "--database", store.database])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def stored(store: Store) -> list[tuple[Any, ...]]:
    return store.query_rows("SELECT request_id, run_id, tenant_id, toString(ts), cause, sub_cause, scenario "
                            "FROM workload_labels ORDER BY request_id")


def test_import_loads_each_label_once_and_dead_letters_bad_lines(store: Store, tmp_path: Path) -> None:
    store.insert("gateway_requests", [r for r in gateway_rows() if r[0] == "cap-1-cold"], GATEWAY_COLUMNS)
    path = write_labels(tmp_path, [
        {"request_id": "r1", "tenant_id": "acme", "pathology": "none", "ts": f"{DAY}T12:00:00Z", "run_id": "x"},
        {"request_id": "r2", "tenant_id": "globex", "pathology": "volatile_system", "ts": f"{DAY}T12:00:01Z"},
        {"request_id": "cap-1-cold", "cause": "cold"},  # no ts, no tenant: the gateway's
        {"request_id": "r3", "pathology": "bogus", "ts": f"{DAY}T12:00:02Z"},
        {"request_id": "r4", "cause": "cold"},  # no ts, and no gateway request: refused
        "{truncated",
        {"request_id": "r1", "tenant_id": "acme", "pathology": "none", "ts": f"{DAY}T12:00:00Z"},  # repeated
    ])
    code, out, err = cli(store, "import", "labels", str(path))
    assert code == 0, err
    assert out.strip() == f"{path}: 3 labels, 1 already stored, 3 bad lines (3 new dead letters)"
    assert "1 × no cause, and pathology 'bogus' is not one kvscope maps" in err
    assert "1 × no ts, and the store holds no gateway request with this request_id" in err
    assert "1 × not JSON" in err
    run = path.stem  # lines without run_id take the file's name
    assert stored(store) == [
        ("cap-1-cold", run, "acme", f"{DAY} 12:00:40.000", "cold", "", "cold"),
        ("r1", "x", "acme", f"{DAY} 12:00:00.000", "none", "", "none"),
        ("r2", run, "globex", f"{DAY} 12:00:01.000", "prefix_drift", "volatile_system", "volatile_system"),
    ]
    letters = store.query_rows("SELECT source, reason, location, raw FROM dead_letters FINAL ORDER BY location")
    assert [(s, loc.rsplit(":", 1)[0]) for s, _, loc, _ in letters] == [("workload_labels", str(path))] * 3
    assert {raw for *_, raw in letters} >= {"{truncated"}
    # again, and with another run id: nothing new (each request once, the first import wins), no new dead letters
    code, out, _ = cli(store, "import", "labels", str(path), "--run-id", "other")
    assert code == 0 and out.strip() == f"{path}: 0 labels, 4 already stored, 3 bad lines (0 new dead letters)"
    assert len(stored(store)) == 3
    assert store.query_rows("SELECT count() FROM dead_letters")[0][0] == 3


def test_two_labelled_runs_reusing_ids_keep_a_label_each(store: Store, tmp_path: Path) -> None:
    # demo/workload.py's ids are deterministic: run 2 labels r1 again, an hour later; a label is (request_id, ts)
    first = write_labels(tmp_path, [{"request_id": "r1", "cause": "cold", "ts": f"{DAY}T12:00:00Z", "run_id": "a"}])
    code, out, err = cli(store, "import", "labels", str(first))
    assert code == 0, err
    second = tmp_path / "second.jsonl"
    second.write_text(json.dumps({"request_id": "r1", "cause": "evicted", "ts": f"{DAY}T13:00:00Z", "run_id": "b"})
                      + "\n")
    code, out, err = cli(store, "import", "labels", str(second))
    assert code == 0 and out.strip() == f"{second}: 1 labels, 0 already stored, 0 bad lines (0 new dead letters)"
    code, out, err = cli(store, "import", "labels", str(second))  # again: the same (request_id, ts), skipped
    assert code == 0 and "0 labels, 1 already stored" in out
    assert store.query_rows("SELECT run_id, cause FROM workload_labels ORDER BY ts") == [("a", "cold"),
                                                                                          ("b", "evicted")]


def test_import_exits_1_when_no_line_is_usable(store: Store, tmp_path: Path) -> None:
    path = write_labels(tmp_path, ["{}", '{"request_id": "r", "cause": "cold", "ts": "yesterday"}'], "bad.jsonl")
    code, out, err = cli(store, "import", "labels", str(path))
    assert code == 1
    assert "2 bad lines" in out and "Error: no label loaded: every line was refused" in err
    assert "field ts: not an ISO 8601 time" in err


def test_a_tail_loads_complete_lines_as_they_are_written(store: Store, tmp_path: Path) -> None:
    path = write_labels(tmp_path, [], "tail.jsonl")
    tail = LabelTail(store, path.with_name("absent.jsonl"))
    assert tail.poll() is None  # the workload has not written yet
    tail = LabelTail(store, path, run_id="0101")
    line = json.dumps({"request_id": "t1", "pathology": "none", "ts": f"{DAY}T12:00:00Z"})
    with path.open("a") as fh:
        fh.write(line + "\n" + line.replace("t1", "t2")[:20])  # t2's line half written
    assert tail.poll().rows == 1
    with path.open("a") as fh:
        fh.write(line.replace("t1", "t2")[20:] + "\n")
    stats = tail.poll()
    assert (stats.rows, stats.reasons, tail.rows) == (1, {}, 2)
    assert tail.poll().lines == 0
    assert [r[:2] for r in stored(store)] == [("t1", "0101"), ("t2", "0101")]



def test_a_large_label_file_streams_in_bounded_memory_and_a_rerun_loads_each_line_once(store: Store,
                                                                                      tmp_path: Path) -> None:
    """`kvscope import labels` read each file whole, then held a parsed row per line: Python's allocations were
    many times the file's size. The file is now read in blocks and loaded a chunk at a time: a load stopped after
    three chunks (Ctrl-C: ``stop``) wrote exactly those, and the load again of the 20 MB file, under tracemalloc,
    allocates at its peak a small fraction of the file (a chunk of 1,000 lines, a read block), not a multiple of
    it; across the two runs every good line is stored once and every bad line is one dead letter."""
    import threading
    import tracemalloc

    n, per_chunk, pad = 100_000, 1_000, "x" * 120
    lines = [json.dumps({"request_id": f"big-{i}", "tenant_id": "acme", "pathology": "none", "note": pad,
                         "ts": f"{DAY}T12:{i // 60_000 % 60:02d}:{i // 1000 % 60:02d}.{i % 1000:03d}Z"})
             if i % 997 else f"not json {i}" for i in range(n)]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    size = path.stat().st_size
    bad = sum(1 for line in lines if line.startswith("not json"))
    assert size > 20_000_000 and bad == 101

    stop = threading.Event()
    seen: list[int] = []

    def progress(stats: Any) -> None:
        seen.append(stats.lines)
        if len(seen) == 3:
            stop.set()  # as Ctrl-C does, while the third chunk's rows are written

    first = load_labels(store, path, lines_per_chunk=per_chunk, stop=stop, progress=progress)
    assert first.interrupted and seen == [1_000, 2_000, 3_000] and first.lines == 3_000
    bad_first = sum(1 for line in lines[:3_000] if line.startswith("not json"))
    assert (first.rows, first.reasons.total(), first.dead_letters) == (3_000 - bad_first, bad_first, bad_first)
    assert first.end_offset == sum(len(line) + 1 for line in lines[:3_000])
    assert store.query_rows("SELECT count() FROM workload_labels")[0][0] == 3_000 - bad_first

    tracemalloc.start()
    try:
        again = load_labels(store, path, lines_per_chunk=per_chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # reading the file whole costs at least its size (the old code: ~8.8 times); the chunked load a few MB
    # (3.3 MB alone, 8.8 MB in CI's process, where tracemalloc also sees other threads' allocations)
    assert peak < size * 0.75, f"peak {peak:,} bytes for a file of {size:,}"
    assert not again.interrupted and again.lines == n and again.end_offset == size
    assert (again.rows, again.duplicates) == (n - bad - first.rows, first.rows)
    assert (again.reasons.total(), again.dead_letters) == (bad, bad - bad_first)
    assert store.query_rows("SELECT count(), uniqExact(request_id) FROM workload_labels") == [(n - bad, n - bad)]
    assert store.query_rows("SELECT count(), uniqExact(location) FROM dead_letters "
                            "WHERE source = 'workload_labels'") == [(bad, bad)]


def test_a_label_line_of_8_mib_or_more_is_a_dead_letter_and_costs_only_itself(store: Store, tmp_path: Path) -> None:
    """The streamed reader keeps a line's first MAX_LINE_BYTES and skips the rest unread (as for a gateway log):
    such a line is one dead letter saying so, and the lines after it load at their offsets."""
    from collector.gateway_log import MAX_LINE_BYTES

    ok = json.dumps({"request_id": "after-long", "pathology": "none", "ts": f"{DAY}T12:00:00Z"})
    long = '{"request_id": "long", "pathology": "none", "note": "' + "x" * MAX_LINE_BYTES + '"}'
    path = tmp_path / "long.jsonl"
    path.write_text(long + "\n" + ok + "\n")
    stats = load_labels(store, path)
    assert (stats.rows, dict(stats.reasons)) == (1, {f"line longer than {MAX_LINE_BYTES} bytes": 1})
    assert [r[0] for r in stored(store)] == ["after-long"]
    assert store.query_rows("SELECT location, length(raw) FROM dead_letters") == [(f"{path}:0", 64 * 1024)]

def test_lines_the_store_could_not_hold_are_bad_lines_not_a_traceback(store: Store, tmp_path: Path) -> None:
    """Expected tokens that add up past UInt32 and a lone surrogate (JSON's \\ud800) used to reach the store and
    fail the whole file; each is now a bad line with its reason and the rest loads."""
    path = tmp_path / "labels.jsonl"
    path.write_text(
        json.dumps({"request_id": "big", "cause": "cold", "ts": f"{DAY}T12:00:00Z", "expected_tokens": [
            {"cause": "cold", "tokens": 2**32 - 1}, {"cause": "cold", "tokens": 10}]}) + "\n"
        + '{"request_id": "r-\\ud800", "cause": "cold", "ts": "' + DAY + 'T12:00:01Z"}\n'
        + json.dumps({"request_id": "ok", "cause": "cold", "ts": f"{DAY}T12:00:02Z"}) + "\n")
    code, out, err = cli(store, "import", "labels", str(path))
    assert code == 0, err
    assert out.strip() == f"{path}: 1 labels, 0 already stored, 2 bad lines (2 new dead letters)"
    assert "1 × expected_tokens: the tokens of cold/- add up past 2^32-1" in err
    assert "1 × field request_id: not valid Unicode (a lone surrogate at character 2)" in err
    assert [r[0] for r in stored(store)] == ["ok"]


# -- the query against its definitions on random data ------------------------------------------------------------
def _reference_agreement(labels: list[dict[str, Any]], answers: dict[str, list[tuple[str, str, int]]],
                         by_sub: bool, confusion: bool) -> dict[tuple[str, str, str, str], tuple[Any, ...]]:
    """attribution_agreement's definitions (docs/miss-causes.md, "Validating attribution") in plain Python:
    ``answers`` maps each evaluated request to its current answer's (cause, sub_cause, tokens) entries."""
    cells: dict[tuple[str, str, str, str], list[int]] = {}
    for lab in labels:
        entries = answers.get(lab["request_id"])
        if entries is None:
            continue
        pooled: dict[tuple[str, str], int] = {}
        for c, sc, n in entries:
            if c != "unavoidable":
                pooled[(c, sc if by_sub else "")] = pooled.get((c, sc if by_sub else ""), 0) + n
        top = min(pooled.items(), key=lambda kv: (-kv[1], kv[0]))[0] if pooled else ("none", "")
        expected = sorted(zip(lab["expected_causes"], lab["expected_sub_causes"], lab["expected_tokens"],
                              strict=True))
        checked = bool(expected)
        cell = cells.setdefault((lab["cause"], lab["sub_cause"] if by_sub else "", *top), [0, 0, 0])
        cell[0] += 1
        cell[1] += checked
        cell[2] += checked and expected == sorted(entries)
    out: dict[tuple[str, str, str, str], tuple[Any, ...]] = {}
    classes = {k[:2] for k in cells} | {k[2:] for k in cells}
    labelled = {c: sum(v[0] for k, v in cells.items() if k[:2] == c) for c in classes}
    attributed = {c: sum(v[0] for k, v in cells.items() if k[2:] == c) for c in classes}
    if confusion:
        for k, (n, chk, ex) in cells.items():
            out[k] = (n, labelled[k[:2]], attributed[k[2:]], n / attributed[k[2:]], n / labelled[k[:2]], chk, ex)
        return out
    total = [0] * 5
    for c in classes:
        matched = cells.get((*c, *c), [0])[0]
        chk = sum(v[1] for k, v in cells.items() if k[:2] == c)
        ex = sum(v[2] for k, v in cells.items() if k[:2] == c)
        row = (matched, labelled[c], attributed[c], matched / attributed[c] if attributed[c] else None,
               matched / labelled[c] if labelled[c] else None, chk, ex)
        out[(*c, *c)] = row
        if c[0] != "none":
            total = [t + x for t, x in zip(total, (matched, labelled[c], attributed[c], chk, ex), strict=True)]
    if any(c[0] != "none" for c in classes):
        out[("all", "", "all", "")] = (total[0], total[1], total[2], total[0] / total[2] if total[2] else None,
                                       total[0] / total[1] if total[1] else None, total[3], total[4])
    return out


def test_agreement_equals_its_definitions_on_random_labels_and_answers(chdb_dir: Path) -> None:
    """300 random labelled requests: random intended classes, answers with several causes (ties, unavoidable,
    replaced answers, requests that failed or were never answered), every (by_sub_cause, confusion) pair."""
    import random

    rng = random.Random(7)
    s = Store.open(data_dir=chdb_dir, database=f"lbr_{uuid.uuid4().hex[:12]}")
    s.migrate()
    classes = [("cold", ""), ("routed_away", ""), ("evicted", ""), ("evicted", "cache_reset"),
               ("prefix_drift", "tools_reordered"), ("prefix_drift", "volatile_system"), ("below_block", "")]
    gw_names = ["request_id", "ts", "tenant_id", "pod", "status", "prompt_tokens"]
    gateway, answers_rows, labels, current = [], [], [], {}
    for i in range(300):
        rid, ts = f"r{i}", at(i)
        status = 500 if i % 37 == 0 else 200
        gateway.append((rid, ts, "t", "pod-a", status, 100))
        cause, sub = rng.choice([("none", ""), *classes])
        k = rng.randint(0, 2)
        expected = [(*rng.choice(classes), rng.choice([4, 8, 8])) for _ in range(k)]
        labels.append({"request_id": rid, "ts": ts, "tenant_id": "t", "run_id": "r", "scenario": cause,
                       "cause": cause, "sub_cause": sub, "expected_causes": [e[0] for e in expected],
                       "expected_sub_causes": [e[1] for e in expected], "expected_tokens": [e[2] for e in expected],
                       "location": ""})
        if i % 23 == 0:
            continue  # never answered
        drawn = expected if rng.random() < 0.5 else [(*rng.choice(classes), rng.choice([4, 8]))
                                                     for _ in range(rng.randint(0, 3))]
        merged: dict[tuple[str, str], int] = {}
        for c, sc, n in [*drawn, ("unavoidable", "", rng.choice([1, 9]))]:
            merged[(c, sc)] = merged.get((c, sc), 0) + n
        entries = sorted((c, sc, n) for (c, sc), n in merged.items())
        versions = [entries]
        if i % 5 == 0:  # replaced: a stale answer, cancelled, then the current one
            versions = [[(*rng.choice(classes), 50)], entries]
        for v, e in enumerate(versions, start=1):
            row = {"request_id": rid, "ts": ts, "tenant_id": "t", "pod": "pod-a", "causes": [x[0] for x in e],
                   "sub_causes": [x[1] for x in e], "missed_tokens": [x[2] for x in e], "version": v}
            answers_rows.append({**row, "sign": 1})
            if v < len(versions):
                answers_rows.append({**row, "sign": -1})
        if status < 400:
            current[rid] = entries
    s.insert("gateway_requests", gateway, gw_names)
    s.insert("workload_labels", [tuple(lab[c] for c in LABEL_NAMES) for lab in labels], LABEL_NAMES)
    names = list(answers_rows[0])
    s.insert("request_attribution", [tuple(r[c] for c in names) for r in answers_rows], names)
    for by_sub in (0, 1):
        for confusion in (0, 1):
            got = {k: figures(v) for k, v in agreement(s, by_sub_cause=by_sub, confusion=confusion).items()}
            want = _reference_agreement(labels, current, bool(by_sub), bool(confusion))
            assert got == want, (by_sub, confusion)


LABEL_NAMES = ["request_id", "ts", "tenant_id", "run_id", "scenario", "cause", "sub_cause", "expected_causes",
               "expected_sub_causes", "expected_tokens", "location"]
