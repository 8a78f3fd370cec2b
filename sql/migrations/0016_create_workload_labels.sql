-- workload_labels: the ground truth of a labelled workload (the demo's, demo/workload.py, or any test traffic),
-- one row per request: the miss cause its prompt was built to show (cause, sub_cause; 'none' = nothing avoidable
-- should miss), the scenario it belongs to, the run that sent it and, where the sender knows it, the expected
-- split of its missed tokens (parallel arrays, as in request_attribution). Read by the named query
-- attribution_agreement (docs/miss-causes.md, "Validating attribution"). Loaded by `kvscope import labels` and
-- by `kvscope demo` as it runs (ingest/labels.py).
--
-- MergeTree written exactly once, not ReplacingMergeTree: the loader asks which request_ids the table holds and
-- inserts only the others (ingest/dedup.py, identity request_id), as the ingester does for gateway_requests. The
-- agreement query counts labels; a copy left until a merge (or read without FINAL) would count a request twice,
-- and FINAL on every read is what the rest of the store avoids. Labels are ground truth, never revised in place:
-- the first import of a request wins (to correct one, ALTER TABLE ... DELETE it and import again).
CREATE TABLE IF NOT EXISTS workload_labels
(
    request_id           String,
    ts                   DateTime64(3, 'UTC'),
    tenant_id            LowCardinality(String),
    run_id               String,
    scenario             LowCardinality(String),
    cause                LowCardinality(String),
    sub_cause            LowCardinality(String),
    expected_causes      Array(LowCardinality(String)),
    expected_sub_causes  Array(LowCardinality(String)),
    expected_tokens      Array(UInt32),
    location             String,
    imported_at          DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY request_id
TTL toDateTime(ts) + INTERVAL 30 DAY;
