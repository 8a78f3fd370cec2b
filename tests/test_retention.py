"""Rows already older than their table's retention (ingest/retention.py): ClickHouse drops them at insert and
the INSERT still succeeds, so without a check a backfill of an old log or a replay that lags past the
retention reports rows that no query sees, and every re-import adds them again to the 400-day rollups (the
exactly-once check finds nothing in the raw table). Each writer sets them aside, counts them and
dead-letters them with the reason; nothing else of the batch changes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from collector.events import DeadLetter, envelope
from collector.gateway_log import read_file
from ingest.bulk import load_gateway_log
from ingest.labels import load_labels
from ingest.retention import read_retentions
from ingest.store import Store
from kvscope.cli import main
from kvscope.importer import import_events, import_metrics
from tests.test_import_metrics import with_usage

NOW = datetime.now(UTC).replace(microsecond=0)
OLD = NOW - timedelta(days=40)  # outside the 30-day retention of the raw tables
EDGE = NOW - timedelta(days=29, hours=23)  # an hour inside it
RECENT = NOW - timedelta(hours=3)


@pytest.fixture(autouse=True)
def _times_from_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOW, OLD, EDGE and RECENT from each test's own start: stamped once at import, EDGE left the retention in a
    session that reached these tests more than an hour later (a loaded CI machine)."""
    now = datetime.now(UTC).replace(microsecond=0)
    for name, value in (("NOW", now), ("OLD", now - timedelta(days=40)),
                        ("EDGE", now - timedelta(days=29, hours=23)), ("RECENT", now - timedelta(hours=3))):
        monkeypatch.setitem(globals(), name, value)


def line(request_id: str, ts: datetime) -> dict[str, Any]:
    return {"log_version": 1, "request_id": request_id, "ts": ts.isoformat().replace("+00:00", "Z"),
            "tenant_id": "acme", "status": 200, "prompt_tokens": 100, "cached_tokens": 64, "ttft_ms": 5.0,
            "e2e_ms": 9.0}


def gateway_log(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in [line("old-1", OLD), line("edge", EDGE),
                                                            line("old-2", OLD + timedelta(minutes=5)),
                                                            line("recent", RECENT)]))
    return path


def stored(store: Store) -> list[str]:
    return [r[0] for r in store.query_rows("SELECT request_id FROM gateway_requests ORDER BY request_id")]


def rollup_requests(store: Store) -> int:
    return store.query_rows("SELECT sum(requests) FROM requests_1h")[0][0] or 0


def letters(store: Store) -> list[tuple[str, str, str]]:
    return store.query_rows("SELECT reason, location, raw FROM dead_letters ORDER BY location")


def test_the_store_reports_each_tables_retention(store: Store) -> None:
    got = read_retentions(store)
    gateway = got["gateway_requests"]
    assert (gateway.column, gateway.text) == ("ts", "toDateTime(ts) + toIntervalDay(30)")
    assert abs(gateway.cutoff - (datetime.now(UTC) - timedelta(days=30))) < timedelta(minutes=1)
    assert got["requests_1h"].text == "minute + toIntervalDay(400)"
    assert "kv_block_events" not in got  # no TTL
    assert gateway.expired(OLD) and not gateway.expired(EDGE)
    assert gateway.expired(gateway.cutoff) and not gateway.expired(gateway.cutoff + timedelta(seconds=1))
    # an operator's ALTER is what applies
    store.command("ALTER TABLE gateway_requests MODIFY TTL toDateTime(ts) + INTERVAL 90 DAY")
    assert not read_retentions(store)["gateway_requests"].expired(OLD)


def test_clickhouse_drops_an_expired_row_at_insert_without_an_error(store: Store) -> None:
    """Why the check exists: the INSERT succeeds and the row is gone (the rollups still see it)."""
    store.command("INSERT INTO gateway_requests (request_id, ts, tenant_id, status, prompt_tokens) "
                  "VALUES ('direct', {ts:DateTime64(3, 'UTC')}, 'acme', 200, 10)", {"ts": OLD})
    assert stored(store) == [] and rollup_requests(store) == 1


def test_live_path_dead_letters_expired_requests_once_and_keeps_the_rest(store: Store, tmp_path: Path) -> None:
    events = read_file(gateway_log(tmp_path))
    assert import_events(store, events) == {"gateway_requests": 2, "dead_letters": 2}
    assert stored(store) == ["edge", "recent"]
    got = letters(store)
    assert len(got) == 2
    for reason, _, _ in got:
        assert reason.startswith("older than the retention of gateway_requests (TTL toDateTime(ts) + "
                                 "toIntervalDay(30)): ts ")
        assert "ClickHouse would drop the row at insert" in reason
    assert sorted(json.loads(raw)["request_id"] for *_, raw in got) == ["old-1", "old-2"]
    assert rollup_requests(store) == 2
    # redelivered: nothing new anywhere, the rollups do not count the old requests
    assert import_events(store, events) == {}
    assert len(letters(store)) == 2 and rollup_requests(store) == 2


def test_bulk_import_counts_expired_lines_and_a_reimport_adds_nothing(store: Store, tmp_path: Path) -> None:
    path = gateway_log(tmp_path)
    stats = load_gateway_log(store, path)
    assert (stats.lines, stats.rows, stats.duplicates, stats.expired, stats.dead_letters) == (4, 2, 0, 2, 1)
    assert stored(store) == ["edge", "recent"]
    [(reason, location, raw)] = letters(store)
    assert reason.startswith("2 rows older than the retention of gateway_requests (TTL toDateTime(ts) + "
                             "toIntervalDay(30)): ts at or before ")
    assert location.startswith(f"{path}:0-") and raw.split("\n") == ["old-1", "old-2"]
    assert rollup_requests(store) == 2
    again = load_gateway_log(store, path)
    assert (again.rows, again.duplicates, again.expired, again.dead_letters) == (0, 2, 2, 0)
    assert rollup_requests(store) == 2 and len(letters(store)) == 1


def test_cli_import_says_how_many_lines_were_too_old(store: Store, tmp_path: Path) -> None:
    path = gateway_log(tmp_path)
    result = CliRunner().invoke(main, ["import", "gateway-log", str(path), "--data-dir",
                                       store.dsn.removeprefix("chdb://"), "--database", store.database])
    assert result.exit_code == 0, result.output
    assert f"{path}: 2 requests, 0 already stored, 1 dead letters" in result.stdout
    assert "2 lines not loaded: older than the retention of gateway_requests" in result.stderr


def test_an_old_metrics_snapshot_is_refused_with_the_reason(store: Store, tmp_path: Path) -> None:
    result = import_metrics(store, "pod-a", tmp_path / "m.txt", with_usage(0.5), int(OLD.timestamp() * 1000))
    assert (result.series, result.configs) == (0, 0)
    [reason] = result.reasons
    assert reason.startswith("older than the retention of vllm_metrics (TTL toDateTime(ts) + toIntervalDay(30))")
    assert store.query_rows("SELECT count() FROM vllm_metrics")[0][0] == 0
    assert [r[0] for r in letters(store)] == [reason]


def test_an_old_label_is_a_bad_line_with_the_reason(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps({"request_id": rid, "tenant_id": "acme", "cause": "cold",
                                        "ts": ts.isoformat()}) + "\n" for rid, ts in [("old", OLD), ("new", RECENT)]))
    stats = load_labels(store, path, run_id="r")
    assert (stats.rows, stats.dead_letters) == (1, 1)
    [reason] = stats.reasons
    assert reason.startswith("older than the retention of workload_labels")
    assert store.query_rows("SELECT request_id FROM workload_labels") == [("new",)]


def test_an_old_dead_letter_is_kept_stamped_when_stored(store: Store) -> None:
    """A collector's dead letter observed long ago (a backlog replayed late) is not lost to the TTL."""
    dl = DeadLetter(source="gateway_log", reason="not JSON", raw="{", location="g.jsonl:0")
    ev = envelope(dl, pod="p", natural_key=("g.jsonl", 0), observed_at_ms=int(OLD.timestamp() * 1000))
    assert import_events(store, [ev]) == {"dead_letters": 1}
    [(reason, ts)] = store.query_rows("SELECT reason, ts FROM dead_letters")
    assert reason == "not JSON" and ts.replace(tzinfo=UTC) > NOW - timedelta(minutes=5)
    assert import_events(store, [ev]) == {}  # once
