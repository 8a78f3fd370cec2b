-- Input that could not be used, with its reason: malformed /metrics bodies, log lines, KV events, and
-- envelopes the ingester rejected. ReplacingMergeTree keyed by (source, event_id): the id comes from where
-- the input was and what it said, so re-reading the same bad line (a restart, a re-import) collapses instead
-- of counting twice; read with FINAL for exact counts. TTL keeps the table from growing without bound.
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
ENGINE = ReplacingMergeTree
ORDER BY (source, event_id)
TTL toDateTime(ts) + INTERVAL 30 DAY;
