-- vllm_metrics: the vLLM series kvscope reads (the collector's allowlist, collector/vllm_metrics.py KEEP), one
-- row per series and scrape, with the counter increase the collector computed from its previous sample
-- (restart-aware; docs/reliability.md). Replaces vllm_metric_samples (every sample of every scrape, deltas
-- re-derived by window functions over the window plus a day): a counter that did not move is not sent.
-- * MergeTree written exactly once: the ingester drops scrapes whose (pod, ts) the table holds.
-- * ORDER BY (name, pod, engine, label, ts): queries ask for a few names over a time range.
-- * Codecs: ts DoubleDelta (scrapes are regular), values Gorilla (floats that change slowly).
CREATE TABLE IF NOT EXISTS vllm_metrics
(
    ts          DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1)),
    pod         LowCardinality(String),
    engine      LowCardinality(String),
    model_name  LowCardinality(String),
    name        LowCardinality(String),
    label       LowCardinality(String),
    value       Float64 CODEC(Gorilla, ZSTD(1)),
    increase    Float64 CODEC(Gorilla, ZSTD(1))
)
ENGINE = MergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (name, pod, engine, label, ts)
TTL toDateTime(ts) + INTERVAL 30 DAY;

-- vllm_cache_config: each engine's vllm:cache_config_info labels (block size, KV capacity, hash algorithm), sent
-- on a collector's first scrape of a pod and whenever they change. block_size (tokens per KV block) and
-- bytes_per_token (kv_cache_memory_bytes / kv_cache_size_tokens) are derived once here.
CREATE TABLE IF NOT EXISTS vllm_cache_config
(
    ts               DateTime64(3, 'UTC'),
    pod              LowCardinality(String),
    engine           LowCardinality(String),
    labels           Map(LowCardinality(String), String),
    block_size       UInt32 MATERIALIZED toUInt32OrZero(labels['block_size']),
    bytes_per_token  Float64 MATERIALIZED
        toFloat64OrZero(labels['kv_cache_memory_bytes']) / greatest(toFloat64OrZero(labels['kv_cache_size_tokens']), 1)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (pod, engine, ts)
TTL toDateTime(ts) + INTERVAL 365 DAY;
