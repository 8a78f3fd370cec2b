-- kv_pod_minutes: per pod and minute, the first and last kv_block_log row's time (ms). Precise mode asks, for
-- every chunk of arrivals and every live run, whether each pod's KV events cover an arrival (a log row within
-- the lookback before it: ingest/kv_evidence.py fetch_first_events). Read from kv_block_log itself, that
-- question scanned the pod and ts columns of the whole lookback (a week of the log) each time: its cost grew with
-- the log, not with the requests judged. Bucketed by a lookback that is a whole number of minutes, these rows give
-- the same first and last time per pod and bucket as the log's rows do.
-- Fed by a materialized view on kv_block_log (itself filled by the views on kv_block_events, migration 0017),
-- so it sees every row the log gets, however it got there; a row written twice changes no minimum or maximum.
-- Its retention is the raw tables' (KVSCOPE_RETENTION_DAYS, ingest/store.py RETENTION), as kv_block_log's is.
CREATE TABLE IF NOT EXISTS kv_pod_minutes
(
    pod     LowCardinality(String),
    minute  DateTime('UTC'),
    first   SimpleAggregateFunction(min, DateTime64(3, 'UTC')),
    last    SimpleAggregateFunction(max, DateTime64(3, 'UTC'))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (pod, minute);

CREATE MATERIALIZED VIEW IF NOT EXISTS kv_pod_minutes_mv TO kv_pod_minutes AS
SELECT pod, toStartOfMinute(ts) AS minute, min(ts) AS first, max(ts) AS last
FROM kv_block_log
GROUP BY pod, minute;

-- The log's rows stored before this migration, once.
-- if: SELECT (SELECT count() FROM kv_pod_minutes) = 0 AND (SELECT count() FROM kv_block_log) > 0
INSERT INTO kv_pod_minutes
SELECT pod, toStartOfMinute(ts) AS minute, min(ts) AS first, max(ts) AS last
FROM kv_block_log
GROUP BY pod, minute;

-- model_pod_minutes: per model, pod and minute, the first and last gateway_requests row's arrival (ms). Precise
-- mode counts a pod that holds a block elsewhere only when it served the request's model within the lookback
-- (ingest/kv_evidence.py fetch_model_pods): read from gateway_requests, that scanned the lookback's requests for
-- every chunk and live run; from here, a few rows per model, pod and minute. Same rules as kv_pod_minutes.
CREATE TABLE IF NOT EXISTS model_pod_minutes
(
    model   LowCardinality(String),
    pod     LowCardinality(String),
    minute  DateTime('UTC'),
    first   SimpleAggregateFunction(min, DateTime64(3, 'UTC')),
    last    SimpleAggregateFunction(max, DateTime64(3, 'UTC'))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (model, pod, minute);

CREATE MATERIALIZED VIEW IF NOT EXISTS model_pod_minutes_mv TO model_pod_minutes AS
SELECT model, pod, toStartOfMinute(ts) AS minute, min(ts) AS first, max(ts) AS last
FROM gateway_requests
GROUP BY model, pod, minute;

-- The requests stored before this migration, once.
-- if: SELECT (SELECT count() FROM model_pod_minutes) = 0 AND (SELECT count() FROM gateway_requests) > 0
INSERT INTO model_pod_minutes
SELECT model, pod, toStartOfMinute(ts) AS minute, min(ts) AS first, max(ts) AS last
FROM gateway_requests
GROUP BY model, pod, minute;
