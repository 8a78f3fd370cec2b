-- kv_block_sizes: per pod, the block sizes (tokens per KV block) its BlockStored events declared (vLLM's
-- BlockStored.block_size), with the first time each size was seen in each minute. The attribution job judges a request
-- with its pod's block size at its arrival (ingest/block_sizes.py); for a pod without vllm_cache_config rows it reads
-- the pod's size changes from here, a few rows per pod and minute of events, instead of scanning kv_block_events on
-- every run. A re-sent or split batch only repeats a minimum.
CREATE TABLE IF NOT EXISTS kv_block_sizes
(
    pod         LowCardinality(String),
    minute      DateTime('UTC'),
    block_size  UInt32,
    since       SimpleAggregateFunction(min, DateTime64(3, 'UTC'))
)
ENGINE = AggregatingMergeTree
ORDER BY (pod, minute, block_size)
TTL minute + INTERVAL 365 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS kv_block_sizes_mv TO kv_block_sizes AS
SELECT pod, toStartOfMinute(toDateTime(ts, 'UTC')) AS minute, block_size, min(ts) AS since
FROM kv_block_events
WHERE event_type = 'BlockStored' AND block_size > 0
GROUP BY pod, minute, block_size;

-- The sizes of events stored before this migration, once.
-- if: SELECT (SELECT count() FROM kv_block_sizes) = 0 AND (SELECT count() FROM kv_block_events) > 0
INSERT INTO kv_block_sizes
SELECT pod, toStartOfMinute(toDateTime(ts, 'UTC')) AS minute, block_size, min(ts) AS since
FROM kv_block_events
WHERE event_type = 'BlockStored' AND block_size > 0
GROUP BY pod, minute, block_size;
