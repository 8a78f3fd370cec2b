-- kv_event_gaps: runs of vLLM KV-event batches (sequence numbers, inclusive) a collector did not receive live,
-- per pod and engine, with how many it recovered from vLLM's replay socket. A gap that is not `recovered`
-- means the block-level evidence of that pod has a hole between the two times. Few rows: ReplacingMergeTree on
-- the event id collapses a gap reported twice (a collector restart before its acknowledgement).
CREATE TABLE IF NOT EXISTS kv_event_gaps
(
    event_id          String,
    detected_at       DateTime64(3, 'UTC'),
    pod               LowCardinality(String),
    engine            LowCardinality(String),
    first_seq         UInt64,
    last_seq          UInt64,
    missing_batches   UInt64 MATERIALIZED last_seq - first_seq + 1,
    reason            LowCardinality(String),
    replayed_batches  UInt64,
    recovered         Bool,
    ingested_at       DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(detected_at)
ORDER BY (pod, engine, first_seq, event_id)
TTL toDateTime(detected_at) + INTERVAL 90 DAY;
