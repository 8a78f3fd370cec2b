-- Miss-cause attribution: one row per (request, cause, sub_cause) with the missed tokens it explains; the
-- tokens of a request's rows sum to prompt_tokens - cached_tokens (each missed token counted once).
-- Written by the attribution job (ingest/attribution.py), which is deterministic: a rerun writes identical
-- rows, and ReplacingMergeTree(attributed_at) keeps the latest per key.
CREATE TABLE IF NOT EXISTS miss_attribution
(
    request_id              String,
    ts                      DateTime64(3, 'UTC'),
    tenant_id               LowCardinality(String),
    pod                     LowCardinality(String),
    model                   LowCardinality(String),
    cause                   LowCardinality(String),
    sub_cause               LowCardinality(String),
    tokens                  UInt32,
    predecessor_request_id  String,
    predecessor_pod         LowCardinality(String),
    gap_ms                  Nullable(Float64),
    block_size              UInt32,
    attributed_at           DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(attributed_at)
ORDER BY (tenant_id, ts, request_id, cause, sub_cause);

-- Which requests (by ingested_at) the job has attributed: the job resumes after the highest watermark.
CREATE TABLE IF NOT EXISTS attribution_watermark
(
    job          LowCardinality(String),
    ingested_through  DateTime64(3, 'UTC'),
    updated_at   DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY job;
