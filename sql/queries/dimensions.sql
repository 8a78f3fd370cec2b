-- name: dimensions
-- description: The tenants, pods and models seen in the window (for filter lists), with their request counts.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- returns: kind String | tenant, pod or model
-- returns: value String | tenant_id, pod name or model (the gateway log's `model`, vLLM's `model_name` label; non-empty)
-- returns: requests UInt64 | requests in the gateway log (all statuses); 0 for a pod or model only seen in vLLM scrapes
--
-- Reads requests_rollup and vllm_rollup (sql/migrations/0012).
SELECT kind, value, sum(n) AS requests
FROM
(
    SELECT 'tenant' AS kind, CAST(tenant_id AS String) AS value, sum(requests) AS n
    FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
    GROUP BY value
    UNION ALL
    SELECT 'pod' AS kind, CAST(pod AS String) AS value, sum(requests) AS n
    FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
    GROUP BY value
    UNION ALL
    SELECT 'model' AS kind, CAST(model AS String) AS value, sum(requests) AS n
    FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
    GROUP BY value
    UNION ALL
    SELECT DISTINCT pair.1 AS kind, pair.2 AS value, toUInt64(0) AS n
    FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1, names = ['vllm:num_requests_running', 'vllm:kv_cache_usage_perc',
                                                'vllm:gpu_cache_usage_perc'])
    ARRAY JOIN [('pod', CAST(pod AS String)), ('model', CAST(model_name AS String))] AS pair
)
WHERE value != ''
GROUP BY kind, value
ORDER BY kind DESC, value
