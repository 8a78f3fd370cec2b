-- alert_state: one row per alert rule per evaluation (dashboard/alerts.py): its state, value, threshold, message
-- and evidence. Append-only MergeTree read with argMax (named query alert_state): every evaluation stays as the
-- rule's history (when it fired, how often it flapped) and the current state needs no FINAL or merge.
CREATE TABLE IF NOT EXISTS alert_state
(
    rule          LowCardinality(String),
    kind          LowCardinality(String),
    severity      LowCardinality(String),
    state         LowCardinality(String),
    value         Nullable(Float64),
    threshold     Float64,
    message       String,
    evidence      String,
    evaluated_at  DateTime64(3, 'UTC'),
    changed_at    DateTime64(3, 'UTC')
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(evaluated_at)
ORDER BY (rule, evaluated_at)
TTL toDateTime(evaluated_at) + INTERVAL 30 DAY;
