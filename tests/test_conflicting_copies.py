"""A gateway line whose (request_id, ts) the store holds with other values is a conflict, not a redelivery: it is
dead-lettered with the columns that differ, counted, and the stored row never changes; an identical copy stays a
silent duplicate (docs/reliability.md, "Conflicting copies"). Real chDB; the live path through the real broker."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import REGISTRY

from collector.gateway_log import read_file
from ingest.bulk import load_gateway_log
from ingest.store import Store
from kvscope.cli import main
from kvscope.config import build_config
from kvscope.importer import import_events
from kvscope.pipeline import Pipeline
from tests.clock import DAY


def line(rid: str, second: int = 1, **change: Any) -> dict[str, Any]:
    rec = {"log_version": 1, "request_id": rid, "ts": f"{DAY}T12:00:0{second}.000Z", "tenant_id": "acme",
           "pod": "pod-0", "model": "tiny", "prompt_tokens": 762, "cached_tokens": 736, "completion_tokens": 8,
           "ttft_ms": 50.0, "e2e_ms": 80.0, "status": 200}
    rec.update(change)
    return rec


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def stored(store: Store) -> list[tuple[Any, ...]]:
    return store.query_rows("SELECT request_id, pod, prompt_tokens, cached_tokens, status FROM gateway_requests "
                            "ORDER BY request_id, ts")


def letters(store: Store) -> list[tuple[str, str]]:
    return store.query_rows("SELECT reason, raw FROM dead_letters ORDER BY location")


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


FIRST = [line("a"), line("n", cached_tokens=None), line("z", cached_tokens=0)]
# after FIRST is stored: an identical copy spelled otherwise (key order, ts form), copies that differ, and a
# pair inside the file (the first line is stored, the second conflicts with it), and a new request twice
SECOND = [
    {**dict(reversed(list(line("a").items()))), "ts": f"{DAY}T12:00:01Z"},
    line("a", pod="pod-9", cached_tokens=0),
    line("n", cached_tokens=None),
    line("z", cached_tokens=None),
    line("b", status=500),
    line("b", status=200, prompt_tokens=999),
    line("c"),
    line("c"),
]
EXPECTED_ROWS = [("a", "pod-0", 762, 736, 200), ("b", "pod-0", 762, 736, 500), ("c", "pod-0", 762, 736, 200),
                 ("n", "pod-0", 762, None, 200), ("z", "pod-0", 762, 0, 200)]


def conflict_columns(reasons: list[str]) -> list[str]:
    """The differing columns each reason names, in the order of the reasons."""
    return [r.split(": ", 1)[1].split(" differ")[0] for r in reasons]


@pytest.mark.parametrize("lines_per_chunk", [50_000, 2])
def test_import_dead_letters_a_conflicting_line_and_keeps_the_stored_row(store: Store, tmp_path: Path,
                                                                       lines_per_chunk: int) -> None:
    """Whatever the chunking, the first line of an identity is stored and every later one with other values is
    a conflict; an identical copy (spelled otherwise, NULL equal to NULL) is a duplicate."""
    load_gateway_log(store, write(tmp_path / "first.jsonl", FIRST))
    second = write(tmp_path / "second.jsonl", SECOND)
    stats = load_gateway_log(store, second, lines_per_chunk=lines_per_chunk)
    assert (stats.lines, stats.rows, stats.duplicates, stats.conflicts, stats.dead_letters) == (8, 2, 3, 3, 3)
    assert stored(store) == EXPECTED_ROWS
    got = letters(store)
    assert sorted(raw for _, raw in got) == sorted(json.dumps(SECOND[i]) for i in (1, 3, 5))
    assert all(r.startswith("conflicts with what gateway_requests holds for its (request_id, ts): ") and
               r.endswith(" differ (the stored one is kept)") for r, _ in got)
    by_line = {raw: columns for (_, raw), columns in zip(got, conflict_columns([r for r, _ in got]), strict=True)}
    assert [by_line[json.dumps(SECOND[i])] for i in (1, 3, 5)] == ["pod, cached_tokens", "cached_tokens",
                                                                   "status, prompt_tokens"]
    again = load_gateway_log(store, second, lines_per_chunk=lines_per_chunk)  # nothing new: counted, not re-stored
    assert (again.rows, again.duplicates, again.conflicts, again.dead_letters) == (0, 5, 3, 0)
    assert stored(store) == EXPECTED_ROWS and len(letters(store)) == 3
    rollup = store.query_rows("SELECT sum(requests), sum(prompt_tokens) FROM requests_1m")
    assert rollup == [(5, 762 * 4)]  # the rollups count each request once, with the stored values


def test_live_path_dead_letters_a_conflicting_row_and_counts_it(store: Store, tmp_path: Path) -> None:
    """The ingester's check (no transport): the same verdicts as the import, and its counters."""
    def counts() -> tuple[float, float]:
        return (metric("kvscope_ingest_rows_conflicting_total", table="gateway_requests"),
                metric("kvscope_ingest_rows_duplicate_total", table="gateway_requests"))

    import_events(store, read_file(write(tmp_path / "first.jsonl", FIRST)))
    before = counts()
    written = import_events(store, read_file(write(tmp_path / "second.jsonl", SECOND)))
    assert written == {"gateway_requests": 2, "dead_letters": 3}
    assert tuple(b - a for a, b in zip(before, counts(), strict=True)) == (3, 3)
    assert stored(store) == EXPECTED_ROWS
    reasons = [r for r, _ in letters(store)]
    assert sorted(conflict_columns(reasons)) == ["cached_tokens", "pod, cached_tokens", "status, prompt_tokens"]
    assert import_events(store, read_file(tmp_path / "second.jsonl")) == {}  # re-sent: no second dead letter
    assert tuple(b - a for a, b in zip(before, counts(), strict=True)) == (6, 8)
    assert stored(store) == EXPECTED_ROWS and len(letters(store)) == 3


def test_cli_import_says_how_many_lines_conflict(store: Store, tmp_path: Path) -> None:
    load_gateway_log(store, write(tmp_path / "first.jsonl", FIRST))
    path = write(tmp_path / "second.jsonl", SECOND)
    result = CliRunner().invoke(main, ["import", "gateway-log", str(path), "--data-dir",
                                       store.dsn.removeprefix("chdb://"), "--database", store.database])
    assert result.exit_code == 0, result.output
    assert f"{path}: 2 requests, 3 already stored, 3 dead letters" in result.stdout
    assert "3 lines not loaded: the store holds their (request_id, ts) with other values" in result.stderr


@pytest.mark.broker
def test_kafka_path_dead_letters_a_conflicting_copy_and_keeps_the_stored_row(store: Store, kafka_bootstrap: str,
                                                                           tmp_path: Path) -> None:
    """Through the real broker: the first log lands, then the second's conflicts are dead-lettered and counted,
    its identical copies dropped silently, and the stored rows stay."""
    ns = f"conf{uuid.uuid4().hex[:8]}"
    cfg = replace(build_config({}, environ={}), database=store.database, kafka_bootstrap=kafka_bootstrap,
                  state_dir=str(tmp_path / "state"), topic_namespace=ns, consumer_group=f"{ns}-g",
                  attribution_interval_seconds=3600)
    before = metric("kvscope_ingest_rows_conflicting_total", table="gateway_requests")
    pipe = Pipeline(cfg, store=store, collect=True)  # creates the topics; no sources configured
    pipe.start()
    try:
        publish = pipe.collector.publisher.publish  # type: ignore[union-attr]
        publish(read_file(write(tmp_path / "first.jsonl", FIRST)))
        wait_for(lambda: len(stored(store)) == 3, "the first log stored")
        publish(read_file(write(tmp_path / "second.jsonl", SECOND)))
        wait_for(lambda: len(stored(store)) == 5 and len(letters(store)) == 3, "the second log handled")
        time.sleep(1)  # nothing more arrives
    finally:
        pipe.close()
    assert stored(store) == EXPECTED_ROWS
    assert sorted(conflict_columns([r for r, _ in letters(store)])) == ["cached_tokens", "pod, cached_tokens",
                                                                        "status, prompt_tokens"]
    assert metric("kvscope_ingest_rows_conflicting_total", table="gateway_requests") - before == 3


def wait_for(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {what}")


def test_a_second_scrape_of_a_pod_at_the_same_instant_with_other_values_is_a_conflict(store: Store) -> None:
    """vLLM scrapes are identified by (pod, ts) too (a second collector watching the pod under the same name): a
    re-sent scrape is a silent duplicate; another body at that instant is one dead letter
    naming the columns that differ, and the stored scrape stays."""
    from collector.vllm_metrics import scrape_events
    from tests.clock import T0

    body = (Path(__file__).parent / "samples" / "vllm_0.32.0_cpu_real_metrics_1.txt").read_text()
    usage = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} '
    assert usage + "0.0\n" in body
    at_ms = int(T0.timestamp() * 1000)
    first = body.replace(usage + "0.0\n", usage + "0.25\n")
    written = import_events(store, scrape_events("pod-a", "http://a/metrics", first, at_ms, 1.0))
    assert written["vllm_metrics"] >= 2 and written["vllm_cache_config"] == 1  # a baseline: gauges and the config

    def scrape() -> list[tuple[Any, ...]]:
        return store.query_rows("SELECT name, label, engine, toString(value), increase FROM vllm_metrics "
                                "ORDER BY name, label, engine")

    kept = scrape()
    assert ("vllm:kv_cache_usage_perc", "", "0", "0.25", 0.0) in kept
    before = [metric("kvscope_ingest_rows_conflicting_total", table=t) for t in ("vllm_metrics", "vllm_cache_config")]
    assert import_events(store, scrape_events("pod-a", "http://a/metrics", first, at_ms, 1.0)) == {}
    other = body.replace(usage + "0.0\n", usage + "0.75\n")
    assert import_events(store, scrape_events("pod-a", "http://a/metrics", other, at_ms, 1.0)) == {"dead_letters": 1}
    assert scrape() == kept
    [(reason, raw)] = letters(store)
    assert reason == "conflicts with what vllm_metrics holds for its (pod, ts): value differ (the stored one is kept)"
    assert len(raw.split("\n")) == len(kept) and all(json.loads(r)["pod"] == "pod-a" for r in raw.split("\n"))
    # the cache config of that body is the same as the stored one: a duplicate, not a conflict
    after = [metric("kvscope_ingest_rows_conflicting_total", table=t) for t in ("vllm_metrics", "vllm_cache_config")]
    assert [b - a for a, b in zip(before, after, strict=True)] == [len(kept), 0]


def test_every_field_round_trips_so_a_copy_is_never_a_conflict_on_either_path(store: Store, tmp_path: Path) -> None:
    """The comparison is on stored values: lines with every field (hash arrays past 2^63, structural arrays,
    exclusive usage, NULLs) stored by one path and read again by either path are duplicates, none a conflict."""
    from demo.history import gateway_records
    from tests.clock import T0

    records = list(gateway_records(120, seed=3, start=T0, id_prefix="rt"))
    for i, rec in enumerate(records[::2]):
        rec.update(prompt_block_hashes=["ffffffffffffffff", f"{i:016x}"], prompt_block_size=16,
                   system_line_hashes=["8000000000000000", "0123456789abcdef", "00000000000000ff"],
                   system_line_tokens=[5, 0, 7], suffix_chunk_hashes=["fedcba9876543210"], suffix_chunk_tokens=[9],
                   stream=True, tool_latency_ms=12.5, error="x" * 3000, routing_reason="é ✓")
    for rec in records[1::4]:
        rec.update(usage_convention="exclusive", cached_tokens=None, cache_read_input_tokens=100,
                   cache_creation_input_tokens=20)
    whole = write(tmp_path / "whole.jsonl", records)
    half = write(tmp_path / "half.jsonl", records[:60])
    assert import_events(store, read_file(half))["gateway_requests"] == 60  # live first
    stats = load_gateway_log(store, whole)  # then the import: the live path's rows are copies
    assert (stats.rows, stats.duplicates, stats.conflicts, stats.dead_letters) == (60, 60, 0, 0)
    before = metric("kvscope_ingest_rows_duplicate_total", table="gateway_requests")
    assert import_events(store, read_file(whole)) == {}  # the import's rows are copies for the live path
    assert metric("kvscope_ingest_rows_duplicate_total", table="gateway_requests") - before == 120
    again = load_gateway_log(store, whole)
    assert (again.rows, again.duplicates, again.conflicts) == (0, 120, 0)
    assert store.query_rows("SELECT count(), countIf(length(prompt_block_hashes) = 2) FROM gateway_requests") == \
        [(120, 60)]
    assert letters(store) == []


def test_copies_whose_pods_down_differ_only_in_order_or_repeats_are_one_request_on_either_path(
        store: Store, tmp_path: Path) -> None:
    """pods_down is a set of pods (docs/gateway-log.md): a gateway that lists them unsorted, or one twice, logs the
    same request. Stored sorted without repeats, so a copy in another order is a duplicate on both paths; a copy
    naming another pod is still a conflict."""
    first = [line("p", pods_down=["pod-9", "pod-2"]), line("q", pods_down=["pod-2", "pod-2", "pod-1"])]
    copies = [line("p", pods_down=["pod-2", "pod-9"]), line("q", pods_down=["pod-1", "pod-2"]),
              line("p", pods_down=["pod-9", "pod-3"])]
    assert import_events(store, read_file(write(tmp_path / "first.jsonl", first)))["gateway_requests"] == 2
    assert store.query_rows("SELECT request_id, pods_down FROM gateway_requests ORDER BY request_id") == [
        ("p", ["pod-2", "pod-9"]), ("q", ["pod-1", "pod-2"])]
    stats = load_gateway_log(store, write(tmp_path / "copies.jsonl", copies))
    assert (stats.rows, stats.duplicates, stats.conflicts) == (0, 2, 1)
    assert conflict_columns([r for r, _ in letters(store)]) == ["pods_down"]
    written = import_events(store, read_file(write(tmp_path / "again.jsonl", [*reversed(first), copies[2]])))
    assert written == {"dead_letters": 1}  # the unsorted originals are copies; the other pod still a conflict
    imported = load_gateway_log(store, write(tmp_path / "fresh.jsonl", [line("r", pods_down=["z", "a", "z"])]))
    assert imported.rows == 1
    assert store.query_rows("SELECT pods_down FROM gateway_requests WHERE request_id = 'r'") == [(["a", "z"],)]
