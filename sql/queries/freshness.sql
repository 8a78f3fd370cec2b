-- name: freshness
-- description: The latest row of each source per pod (vLLM scrapes, gateway log lines, KV events, attribution answers): when each was last heard from, how long ago, and how many rows it delivered in the window (the dashboard's "last scrape 12 s ago", its start-up state, the source_silent alert).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | look no further back than this, UTC (a source silent since before it has no row)
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | ignore rows from this time on (exclusive), UTC
-- param: pod: String = '' | pod to keep, '' = all
-- returns: source String | vllm_scrape (a /metrics scrape: vllm_metrics), gateway_log (a request logged by the gateway: gateway_requests), kv_events (a KV-cache event: kv_block_events) or attribution (a miss-cause answer written: request_attribution.attributed_at)
-- returns: pod String | the pod (gateway_log: the pod that served the request; '' when the gateway logged none, e.g. a refused request)
-- returns: last_ts DateTime64(3, 'UTC') | the source's latest row for the pod in the window, UTC (the scrape, request, event or answer time)
-- returns: age_seconds Float64 | seconds from last_ts to the store's clock now (negative when the row's clock is ahead)
-- returns: rows UInt64 | what the source delivered for the pod in the window: vllm_scrape scrapes (distinct scrape times), gateway_log lines (requests), kv_events events (an event sent in pieces once: by its piece with first_pos 0, sql/migrations/0029), attribution requests with a current answer (sign-weighted)
--
-- vllm_scrape reads vLLM's num_requests_running and num_requests_waiting gauges only: every scrape carries them
-- (gauges are sent each scrape, counters only when they moved), and the table is sorted by name first. Every
-- source is read over [since, until) on its time column, which bounds the scan (partitions by day, sort keys):
-- the dashboard asks for the last day of data. Requests waiting for an answer = gateway_log rows - attribution
-- rows over the same window (both count requests by arrival time).
SELECT source, pod, last_ts, dateDiff('millisecond', last_ts, now64(3, 'UTC')) / 1000 AS age_seconds, rows
FROM
(
    SELECT 'vllm_scrape' AS source, CAST(m.pod AS String) AS pod, max(m.ts) AS last_ts, uniqExact(m.ts) AS rows
    FROM vllm_metrics AS m
    WHERE m.name IN ('vllm:num_requests_running', 'vllm:num_requests_waiting')
      AND m.ts >= {since:DateTime64(3, 'UTC')} AND m.ts < {until:DateTime64(3, 'UTC')}
      AND ({pod:String} = '' OR m.pod = {pod:String})
    GROUP BY pod
    UNION ALL
    SELECT 'gateway_log' AS source, CAST(g.pod AS String) AS pod, max(g.ts) AS last_ts, count() AS rows
    FROM gateway_requests AS g
    WHERE g.ts >= {since:DateTime64(3, 'UTC')} AND g.ts < {until:DateTime64(3, 'UTC')}
      AND ({pod:String} = '' OR g.pod = {pod:String})
    GROUP BY pod
    UNION ALL
    SELECT 'kv_events' AS source, CAST(k.pod AS String) AS pod, max(k.ts) AS last_ts, countIf(k.first_pos = 0) AS rows
    FROM kv_block_events AS k
    WHERE k.ts >= {since:DateTime64(3, 'UTC')} AND k.ts < {until:DateTime64(3, 'UTC')}
      AND ({pod:String} = '' OR k.pod = {pod:String})
    GROUP BY pod
    UNION ALL
    SELECT 'attribution' AS source, CAST(r.pod AS String) AS pod, max(r.attributed_at) AS last_ts,
           toUInt64(greatest(sum(r.sign), 0)) AS rows
    FROM request_attribution AS r
    WHERE r.ts >= {since:DateTime64(3, 'UTC')} AND r.ts < {until:DateTime64(3, 'UTC')}
      AND ({pod:String} = '' OR r.pod = {pod:String})
    GROUP BY pod
)
ORDER BY source, pod
