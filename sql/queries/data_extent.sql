-- name: data_extent
-- description: What the store holds, per table: rows and the time span they cover (the dashboard's "no data yet" check and "data through" caption).
-- returns: table String | gateway_requests, vllm_metrics, request_attribution, kv_block_events, kv_event_gaps or dead_letters
-- returns: rows UInt64 | rows (request_attribution: requests with a current answer; kv_block_events: KV events, an event sent in pieces once: by its piece with first_pos 0, sql/migrations/0029; kv_event_gaps: gaps, a gap reported again counted once (the kv_gaps view); dead_letters: distinct inputs)
-- returns: first_ts Nullable(DateTime64(3, 'UTC')) | earliest ts, UTC; NULL when the table is empty
-- returns: last_ts Nullable(DateTime64(3, 'UTC')) | latest ts, UTC; NULL when the table is empty
SELECT table, rows, first_ts, last_ts
FROM
(
    SELECT 'gateway_requests' AS table, count() AS rows,
           if(rows = 0, NULL, min(ts)) AS first_ts, if(rows = 0, NULL, max(ts)) AS last_ts
    FROM gateway_requests
    UNION ALL
    SELECT 'vllm_metrics', count() AS rows, if(rows = 0, NULL, min(ts)), if(rows = 0, NULL, max(ts))
    FROM vllm_metrics
    UNION ALL
    SELECT 'request_attribution', toUInt64(sum(sign)) AS rows, if(rows = 0, NULL, min(ts)), if(rows = 0, NULL, max(ts))
    FROM request_attribution
    UNION ALL
    SELECT 'kv_block_events', countIf(first_pos = 0) AS rows, if(rows = 0, NULL, min(ts)), if(rows = 0, NULL, max(ts))
    FROM kv_block_events
    UNION ALL
    SELECT 'kv_event_gaps', count() AS rows, if(rows = 0, NULL, min(detected_at)),
           if(rows = 0, NULL, max(last_detected_at))
    FROM kv_gaps
    UNION ALL
    SELECT 'dead_letters', uniqExact(event_id) AS rows, if(rows = 0, NULL, min(ts)), if(rows = 0, NULL, max(ts))
    FROM dead_letters
)
ORDER BY table
