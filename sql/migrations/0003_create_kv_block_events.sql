-- One row per vLLM KV-cache event (BlockStored / BlockRemoved / AllBlocksCleared) per pod and engine.
-- ReplacingMergeTree keyed by (pod, engine, seq, idx): a re-sent ZMQ batch collapses on merge.
CREATE TABLE IF NOT EXISTS kv_block_events
(
    event_id           String,
    ts                 DateTime64(3, 'UTC'),
    pod                LowCardinality(String),
    engine             LowCardinality(String),
    seq                UInt64,
    idx                UInt32,
    event_type         LowCardinality(String),
    block_hashes       Array(UInt64),
    parent_block_hash  Nullable(UInt64),
    token_count        UInt32,
    block_size         UInt32,
    medium             LowCardinality(String),
    ingested_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
ORDER BY (pod, engine, ts, seq, idx);
