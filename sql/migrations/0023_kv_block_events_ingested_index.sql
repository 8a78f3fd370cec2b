-- The attribution job looks every run for KV events ingested late (ingest/attribution_job.py _late_kv_targets:
-- ingested_at in the run's window, long after their own ts). kv_block_events is sorted by (pod, engine, ts), so
-- without an index on ingested_at that filter reads the whole table every few seconds. A minmax index, as
-- gateway_requests has for the same job (0008), lets ClickHouse skip the granules ingested outside the window
-- (https://clickhouse.com/docs/optimize/skipping-indexes). Parts written before it get the index when merged.
ALTER TABLE kv_block_events ADD INDEX IF NOT EXISTS ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1;
