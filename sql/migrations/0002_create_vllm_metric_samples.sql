-- One row per Prometheus sample of each vLLM /metrics scrape (every name generation kept as exposed).
-- ReplacingMergeTree: a re-sent scrape carries the same event_id; identical rows collapse on merge.
-- ORDER BY (name, pod, engine, ts): queries pick a few metric names and walk each series in time order
-- (counter deltas with lagInFrame).
CREATE TABLE IF NOT EXISTS vllm_metric_samples
(
    event_id     String,
    ts           DateTime64(3, 'UTC'),
    pod          LowCardinality(String),
    engine       LowCardinality(String),
    model_name   LowCardinality(String),
    name         LowCardinality(String),
    labels       Map(LowCardinality(String), String),
    value        Float64,
    ingested_at  DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
ORDER BY (name, pod, engine, labels, ts, event_id);
