"""Storage layout: retention applied from the settings, the cluster DDL, rollups equal the raw aggregates, a
0.1 store migrated in place."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import sql as sqlfiles
from ingest.store import RETENTION, Store, create_database, replicated, split_statements
from tests.clock import T0


def test_retention_is_applied_and_only_when_it_changes(store: Store) -> None:
    changed = store.apply_retention(7, 90)
    assert set(changed) == {t for t, _, _ in RETENTION}
    queries = dict(store.query_rows("SELECT name, create_table_query FROM system.tables "
                                    "WHERE database = currentDatabase()"))
    assert "toIntervalDay(7)" in queries["gateway_requests"] and "toIntervalDay(90)" in queries["requests_1m"]
    assert store.apply_retention(7, 90) == []


def test_the_test_data_is_inside_every_retention() -> None:
    """The stored test data starts at tests/clock.py's T0, which follows the run date: ClickHouse drops rows already
    past a table's TTL at insert, so data on a fixed date would vanish from the tests' tables a month later. T0 is
    36 h to 3 d old (3 d: a suite that crossed midnight after import) and younger than the shortest retention of
    the migrations' TTLs and the retention settings' defaults."""
    from kvscope.config import build_config

    ttl_days = [int(n) for _, text in sqlfiles.migrations()
                for n in re.findall(r"^TTL .*\+ INTERVAL (\d+) DAY", text, flags=re.MULTILINE)]
    assert len(ttl_days) >= 17  # every TTL clause of sql/migrations is read
    cfg = build_config({}, environ={})
    shortest = min(*ttl_days, cfg.retention_days, cfg.rollup_retention_days)
    age = datetime.now(UTC) - T0
    assert timedelta(hours=36) <= age < timedelta(days=3)
    assert age < timedelta(days=shortest)


def test_cluster_ddl_uses_replicated_engines() -> None:
    assert create_database("kv", "main") == ("CREATE DATABASE IF NOT EXISTS kv ON CLUSTER 'main' ENGINE = "
                                             "Replicated('/clickhouse/databases/kv', '{shard}', '{replica}')")
    engines = set()
    for _, text in sqlfiles.migrations():
        for _, statement in split_statements(text):
            out = replicated(statement)
            if "ENGINE" in statement and "MergeTree" in statement:
                assert "ENGINE = Replicated" in out, statement[:200]
                engines.add(out.split("ENGINE = ", 1)[1].split()[0].split("(")[0])
            else:
                assert out == statement
    assert engines == {"ReplicatedMergeTree", "ReplicatedReplacingMergeTree", "ReplicatedAggregatingMergeTree",
                       "ReplicatedVersionedCollapsingMergeTree"}
    assert replicated("CREATE TABLE s (x UInt8) ENGINE = Memory") == "CREATE TABLE s (x UInt8) ENGINE = Memory"


def test_a_cluster_needs_a_server(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cluster needs clickhouse_url"):
        Store.open(data_dir=tmp_path, database=f"c_{uuid.uuid4().hex[:8]}", cluster="main")


def test_every_rollup_equals_the_same_aggregate_over_raw_rows(store: Store) -> None:
    """Minute and hour rollups (sql/migrations/0012, 0014) against GROUP BYs over the raw tables: requests (every
    7th with its cached count not reported), misses (sign-weighted, after a re-attribution replaced answers),
    affinity and vLLM series."""
    import pyarrow as pa

    from bench.history import gateway_table, vllm_table
    from ingest.attribution_job import run_attribution

    table = gateway_table(3000, rate_per_second=5.0, seed=4)
    cached = table["cached_tokens"].to_pylist()
    unknown = pa.array([None if i % 7 == 0 else c for i, c in enumerate(cached)], type=pa.uint32())
    table = table.set_column(table.schema.get_field_index("cached_tokens"), "cached_tokens", unknown)
    store.insert_arrow("gateway_requests", table)
    store.insert_arrow("vllm_metrics", vllm_table(2, seconds=1800, interval_seconds=5.0, seed=4))
    run_attribution(store, settle_seconds=-60)
    store.command("TRUNCATE TABLE attribution_watermark")  # answers exist: a rerun writes nothing new
    run_attribution(store, settle_seconds=-60)

    def same(rollup: str, raw: str) -> None:
        got, want = sorted(store.query_rows(rollup)), sorted(store.query_rows(raw))
        assert got == want and want, (rollup, got[:3], want[:3])

    req_cols = ("sum(requests), sum(served), sum(errors), sum(prompt_tokens), sum(cached_tokens), "
                "sum(completion_tokens), sum(prefix_tokens), round(sum(hit_ratio_sum), 6), "
                "sum(known_served), sum(known_prompt_tokens), "
                "uniqCombinedMerge(fingerprints), uniqCombinedMerge(system_hashes)")
    known = "status < 400 AND prompt_tokens > 0 AND cached_tokens IS NOT NULL"
    raw_req = ("count(), countIf(status < 400 AND prompt_tokens > 0), countIf(status >= 400), "
               "sumIf(toUInt64(prompt_tokens), status < 400 AND prompt_tokens > 0), "
               f"sum(if({known}, toUInt64(assumeNotNull(cached_tokens)), 0)), "
               "sumIf(toUInt64(completion_tokens), status < 400 AND prompt_tokens > 0), "
               "sumIf(toUInt64(greatest(toInt64(prompt_tokens) - toInt64(suffix_tokens), 0)), "
               "status < 400 AND prompt_tokens > 0), "
               f"round(sum(if({known}, assumeNotNull(cached_tokens) / prompt_tokens, 0)), 6), "
               f"countIf({known}), sumIf(toUInt64(prompt_tokens), {known}), "
               "uniqExactIf(prompt_fingerprint, prompt_fingerprint != ''), uniqExactIf(system_hash, system_hash != '')")
    for table, unit in (("requests_1m", "toStartOfMinute"), ("requests_1h", "toStartOfHour")):
        same(f"SELECT minute, tenant_id, pod, {req_cols} FROM {table} GROUP BY minute, tenant_id, pod",
             f"SELECT {unit}(ts), tenant_id, pod, {raw_req} FROM gateway_requests GROUP BY 1, tenant_id, pod")
    for table, unit in (("misses_1m", "toStartOfMinute"), ("misses_1h", "toStartOfHour")):
        same(f"SELECT minute, tenant_id, pod, cause, sub_cause, sum(missed_tokens), sum(requests) FROM {table} "
             "GROUP BY ALL HAVING sum(requests) != 0",
             f"SELECT {unit}(ts), tenant_id, pod, cause, sub_cause, sum(toInt64(n) * sign), sum(toInt64(sign)) "
             "FROM (SELECT * FROM request_attribution FINAL) ARRAY JOIN causes AS cause, sub_causes AS sub_cause, "
             "missed_tokens AS n GROUP BY ALL")
    same("SELECT minute, tenant_id, pod, sum(with_predecessor), sum(predecessor_tokens), sum(same_pod_tokens) "
         "FROM affinity_1m GROUP BY ALL",
         "SELECT toStartOfMinute(ts), tenant_id, pod, "
         "countIf(predecessor_kind IN ('previous_turn', 'fingerprint')), "
         "sumIf(toInt64(prompt_tokens), predecessor_kind IN ('previous_turn', 'fingerprint')), "
         "sumIf(toInt64(prompt_tokens), predecessor_kind IN ('previous_turn', 'fingerprint') "
         "AND predecessor_pod = pod) "
         "FROM request_attribution FINAL GROUP BY ALL")
    for table, unit in (("vllm_1m", "toStartOfMinute"), ("vllm_1h", "toStartOfHour")):
        same(f"SELECT minute, pod, name, label, sum(increase), sum(samples), max(value_max), "
             f"argMaxMerge(last_value) FROM {table} GROUP BY ALL",
             f"SELECT {unit}(ts), pod, name, label, sum(increase), count(), max(value), argMax(value, ts) "
             "FROM vllm_metrics GROUP BY ALL")
    assert store.query_rows("SELECT sum(sign) FROM request_attribution")[0][0] == 3000


def test_a_store_written_by_0_1_is_migrated_in_place(chdb_dir: Path) -> None:
    """Migrations 0001-0007 (kvscope 0.1), 0.1-shaped rows, then the rest: the rows are carried over, the
    materialized views fill request_keys and the rollups, 0.1's tables are gone."""
    s = Store.open(data_dir=chdb_dir, database=f"v01_{uuid.uuid4().hex[:10]}")
    s.command("CREATE TABLE IF NOT EXISTS schema_migrations (version String, applied_at DateTime64(3, 'UTC') "
              "DEFAULT now64(3)) ENGINE = ReplacingMergeTree ORDER BY version")
    for version, text in sqlfiles.migrations():
        if version < "0008":
            s.run_migration(text)
            s.insert("schema_migrations", [(version,)], ["version"])
    from datetime import timedelta

    rows = [(f"ev{i}", f"r{i}", T0 + timedelta(seconds=i), "acme", "c1", "", "tiny", "pod-a", 762,
             0 if i == 0 else 736, "sys", 720, "q", 22, "fp") for i in range(3)]
    cols = ["event_id", "request_id", "ts", "tenant_id", "conversation_id", "agent_run_id", "model", "pod",
            "prompt_tokens", "cached_tokens", "system_hash", "system_tokens", "suffix_hash", "suffix_tokens",
            "prompt_fingerprint"]
    s.insert("gateway_requests", rows + rows[:1], cols)  # a duplicate that 0.1's FINAL collapsed
    samples = [(f"s{k}", T0 + timedelta(seconds=30 * k), "pod-a", "0", "tiny", "vllm:prefix_cache_queries_total",
                {"engine": "0"}, float(1000 + 500 * k)) for k in range(3)]
    samples.append(("cfg", T0, "pod-a", "0", "", "vllm:cache_config_info", {"block_size": "32"}, 1.0))
    s.insert("vllm_metric_samples", samples, ["event_id", "ts", "pod", "engine", "model_name", "name", "labels",
                                              "value"])
    s.migrate()
    tables = {r[0] for r in s.query_rows("SELECT name FROM system.tables WHERE database = currentDatabase()")}
    assert not tables & {"gateway_requests_v1", "vllm_metric_samples", "vllm_counter_deltas"}
    assert s.query_rows("SELECT count(), uniqExact(request_id) FROM gateway_requests")[0] == (3, 3)
    assert s.query_rows("SELECT sum(requests), sum(cached_tokens) FROM requests_1m")[0] == (3, 1472)
    assert s.query_rows("SELECT count() FROM request_keys")[0][0] == 6  # conversation and fingerprint of each
    assert s.query_rows("SELECT sum(increase) FROM vllm_metrics")[0][0] == 1000.0
    assert s.query_rows("SELECT sum(increase) FROM vllm_1m")[0][0] == 1000.0
    assert s.query_rows("SELECT block_size FROM vllm_cache_config")[0][0] == 32
    from ingest.attribution_job import run_attribution

    assert run_attribution(s, settle_seconds=-60).arrivals == 3  # 0.1's answers are re-derived


def migrated_before(chdb_dir: Path, version: str) -> tuple[Store, dict[str, str]]:
    """A new store with the migrations before ``version`` applied and recorded (as a store of an older kvscope), and
    every migration's text by version."""
    s = Store.open(data_dir=chdb_dir, database=f"m{version}_{uuid.uuid4().hex[:10]}")
    s.command("CREATE TABLE IF NOT EXISTS schema_migrations (version String, applied_at DateTime64(3, 'UTC') "
              "DEFAULT now64(3)) ENGINE = ReplacingMergeTree ORDER BY version")
    migrations = dict(sqlfiles.migrations())
    for name, text in migrations.items():
        if name < version:
            s.run_migration(text)
            s.insert("schema_migrations", [(name,)], ["version"])
    return s, migrations


def test_rows_stored_before_0014_stay_known_and_the_migration_reruns(chdb_dir: Path) -> None:
    """Rows and rollups written before 0014 (cached 0 and 736 of 762) keep their values and count as known:
    coverage 1.0, hit rate 736 / (2 × 762); after 0014 a row with a NULL count is not known; rerunning 0014
    changes nothing."""
    from datetime import timedelta

    s, migrations = migrated_before(chdb_dir, "0014")
    cols = ["request_id", "ts", "tenant_id", "pod", "status", "prompt_tokens", "cached_tokens"]
    s.insert("gateway_requests", [("old0", T0, "acme", "pod-a", 200, 762, 0),
                                  ("old1", T0 + timedelta(seconds=1), "acme", "pod-a", 200, 762, 736)], cols)
    assert s.migrate()[0] == "0014_nullable_cached_tokens"  # then any later migrations
    s.insert("gateway_requests", [("new0", T0 + timedelta(seconds=2), "acme", "pod-a", 200, 1000, None)], cols)
    assert s.query_rows("SELECT request_id, cached_tokens FROM gateway_requests ORDER BY request_id") == [
        ("new0", None), ("old0", 0), ("old1", 736)]
    assert s.query_rows("SELECT sum(served), sum(known_served), sum(prompt_tokens), sum(known_prompt_tokens), "
                        "sum(cached_tokens) FROM requests_1m")[0] == (3, 2, 2524, 1524, 736)
    assert s.query_rows("SELECT sum(known_served), sum(known_prompt_tokens) FROM requests_1h")[0] == (2, 1524)
    gw = s.named("hit_rate_total").row(0, named=True)
    assert gw["token_weighted_hit_rate"] == pytest.approx(736 / 1524)
    assert gw["cached_tokens_coverage"] == pytest.approx(1524 / 2524)
    s.run_migration(migrations["0014_nullable_cached_tokens"])  # safe to rerun: the rollups are untouched
    assert s.query_rows("SELECT sum(known_served), sum(known_prompt_tokens) FROM requests_1m")[0] == (2, 1524)


def test_rows_stored_before_0041_keep_their_rollups_and_later_skipped_prompts_count(chdb_dir: Path) -> None:
    """A prompt-logprobs request (skip_reading_prefix_cache, cached NULL) stored before 0041 stays in the rollups as
    it was (skipped 0: the documented cost of the upgrade); one stored after counts its 1,000 prompt tokens as
    skipped, which the tokens query adds to prefill_computed_tokens; rerunning 0041 changes nothing."""
    from datetime import timedelta

    s, migrations = migrated_before(chdb_dir, "0041")
    cols = ["request_id", "ts", "tenant_id", "pod", "status", "prompt_tokens", "cached_tokens",
            "skip_reading_prefix_cache"]
    s.insert("gateway_requests", [("old", T0, "acme", "pod-a", 200, 500, None, True),
                                  ("hit", T0 + timedelta(seconds=1), "acme", "pod-a", 200, 1000, 600, False)], cols)
    assert s.migrate()[0] == "0041_rollup_skipped_prompt_tokens"
    s.insert("gateway_requests", [("new", T0 + timedelta(seconds=2), "acme", "pod-a", 200, 1000, None, True)], cols)
    for table in ("requests_1m", "requests_1h"):
        assert s.query_rows(f"SELECT sum(prompt_tokens), sum(known_prompt_tokens), sum(skipped_prompt_tokens) "
                            f"FROM {table}")[0] == (2500, 1000, 1000), table
    tokens = s.named("tokens").row(0, named=True)
    assert tokens["prefill_computed_tokens"] == (1000 - 600) + 1000
    s.run_migration(migrations["0041_rollup_skipped_prompt_tokens"])
    assert s.query_rows("SELECT sum(skipped_prompt_tokens) FROM requests_1m")[0] == (1000,)


def test_the_tables_read_by_ingestion_time_have_a_minmax_index_on_it(store: Store) -> None:
    """The attribution job filters gateway_requests and kv_block_events on ingested_at every run; both tables are
    sorted by other columns, so each has a minmax skipping index on it (migrations 0008, 0023)."""
    rows = store.query_rows(
        "SELECT table, type, expr FROM system.data_skipping_indices WHERE database = currentDatabase() "
        "AND name = 'ingested_at_minmax' ORDER BY table")
    assert [(r[0], r[1], r[2]) for r in rows] == [("gateway_requests", "minmax", "ingested_at"),
                                                  ("kv_block_events", "minmax", "ingested_at")]
