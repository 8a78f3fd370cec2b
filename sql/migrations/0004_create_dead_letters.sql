-- Input that could not be used, with its reason: malformed /metrics bodies, log lines, KV events, and
-- envelopes the ingester rejected. Plain MergeTree: every occurrence is worth seeing; event_id still allows
-- a dedup query. TTL keeps the table from growing without bound.
CREATE TABLE IF NOT EXISTS dead_letters
(
    event_id     String,
    ts           DateTime64(3, 'UTC'),
    source       LowCardinality(String),
    pod          LowCardinality(String),
    reason       String,
    location     String,
    raw          String,
    ingested_at  DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (source, ts)
TTL toDateTime(ts) + INTERVAL 30 DAY;
