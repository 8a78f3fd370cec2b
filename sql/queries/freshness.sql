-- name: freshness
-- description: How fresh each input is, per source (vLLM scrapes, gateway log lines, KV events, the attribution job's answers) and pod: the latest time stored, its age on the store's clock, and how many rows; the dashboard's "last scrape 12 s ago", its start-up state and its "no new data since".
-- returns: source String | vllm_scrape, gateway_log, kv_events or attribution
-- returns: pod String | the pod; '' = all pods together (each source with any data has this row; attribution has only it)
-- returns: last_ts Nullable(DateTime64(3, 'UTC')) | vllm_scrape: the latest scrape; gateway_log: the latest request's ts; kv_events: the latest event's ts; attribution: when the latest answer was written (attributed_at), UTC
-- returns: age_seconds Nullable(Float64) | now_ts - last_ts, seconds (negative when a source's clock runs ahead of the store's)
-- returns: rows UInt64 | vllm_scrape: scrapes (samples of vllm:num_requests_running or the KV-cache usage gauge, sent with every scrape; the most of any engine and gauge); gateway_log: lines stored (requests); kv_events: events stored; attribution: requests with a current answer
-- returns: waiting UInt64 | attribution: requests in the gateway log without an answer yet (the job answers each a few seconds after it is stored); 0 for the other sources
-- returns: now_ts DateTime64(3, 'UTC') | the store's clock when the query ran, UTC
--
-- Cheap at any size: vLLM scrapes from the vllm_1h rollup (sql/migrations/0012; its last_ts is exact), gateway
-- lines in total from the table's partition min/max and count; per pod, KV events and the latest answer over
-- the last day of data (24 hours before the latest scrape or line; older ones have no per-pod row),
-- waiting from the hour rollups (requests_1h.requests - affinity_1h.answered). A source without data has no row.
WITH
    now64(3, 'UTC') AS now_ts,
    (SELECT max(last_ts) FROM vllm_1h WHERE name IN ('vllm:num_requests_running', 'vllm:kv_cache_usage_perc',
                                                    'vllm:gpu_cache_usage_perc')) AS latest_scrape,
    (SELECT max(ts) FROM gateway_requests) AS latest_line,
    greatest(ifNull(latest_scrape, toDateTime64(0, 3, 'UTC')), ifNull(latest_line, toDateTime64(0, 3, 'UTC')))
        - INTERVAL 1 DAY AS day_ago,
    scrapes AS
    (
        SELECT CAST(pod AS String) AS pod_name, max(engine_last) AS last, max(engine_samples) AS n
        FROM
        (
            SELECT pod, engine, name, max(last_ts) AS engine_last, sum(samples) AS engine_samples
            FROM vllm_1h
            WHERE name IN ('vllm:num_requests_running', 'vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc')
            GROUP BY pod, engine, name
        )
        GROUP BY pod_name
    ),
    gateway_pods AS
    (
        SELECT CAST(pod AS String) AS pod_name, max(ts) AS last, count() AS n
        FROM gateway_requests
        WHERE ts >= day_ago
        GROUP BY pod_name
    ),
    kv_pods AS
    (
        SELECT CAST(pod AS String) AS pod_name, max(ts) AS last, count() AS n
        FROM kv_block_events
        WHERE ts >= day_ago
        GROUP BY pod_name
    ),
    answered AS
    (
        SELECT toInt64(sum(answered)) AS n FROM affinity_1h
    ),
    logged AS
    (
        SELECT toInt64(sum(requests)) AS n FROM requests_1h
    )
SELECT source, pod, last_ts,
       if(last_ts IS NULL, NULL, dateDiff('millisecond', assumeNotNull(last_ts), now_ts) / 1000) AS age_seconds,
       rows, waiting, now_ts
FROM
(
    SELECT 'vllm_scrape' AS source, pod_name AS pod, CAST(last AS Nullable(DateTime64(3, 'UTC'))) AS last_ts,
           toUInt64(n) AS rows, toUInt64(0) AS waiting
    FROM scrapes
    UNION ALL
    SELECT 'vllm_scrape', '', CAST(max(last) AS Nullable(DateTime64(3, 'UTC'))), toUInt64(sum(n)), toUInt64(0)
    FROM scrapes
    HAVING count() > 0
    UNION ALL
    SELECT 'gateway_log', pod_name, CAST(last AS Nullable(DateTime64(3, 'UTC'))), toUInt64(n), toUInt64(0)
    FROM gateway_pods
    UNION ALL
    SELECT 'gateway_log', '', CAST(max(ts) AS Nullable(DateTime64(3, 'UTC'))), toUInt64(count()), toUInt64(0)
    FROM gateway_requests
    HAVING count() > 0
    UNION ALL
    SELECT 'kv_events', pod_name, CAST(last AS Nullable(DateTime64(3, 'UTC'))), toUInt64(n), toUInt64(0)
    FROM kv_pods
    UNION ALL
    SELECT 'kv_events', '', CAST(if((SELECT count() FROM kv_pods) > 0, (SELECT max(last) FROM kv_pods), NULL)
                                 AS Nullable(DateTime64(3, 'UTC'))),
           toUInt64(count()), toUInt64(0)
    FROM kv_block_events
    HAVING count() > 0
    UNION ALL
    SELECT 'attribution', '', CAST(if(count() > 0, max(attributed_at), NULL) AS Nullable(DateTime64(3, 'UTC'))),
           toUInt64(greatest(ifNull((SELECT n FROM answered), 0), 0)),
           toUInt64(greatest(ifNull((SELECT n FROM logged), 0) - ifNull((SELECT n FROM answered), 0), 0))
    FROM request_attribution
    WHERE ts >= day_ago AND sign = 1
    HAVING ifNull((SELECT n FROM answered), 0) > 0 OR ifNull((SELECT n FROM logged), 0) > 0
)
ORDER BY source, pod
