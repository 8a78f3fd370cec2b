-- name: latency
-- description: ttft_ms and queue_wait_ms p50/p95/p99 per bucket: quantiles over the gateway's requests (t-digest: on small sets the nearest rank, at scale within about 1 %), and from vLLM's histograms (vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds) by bucket interpolation of the count deltas, as Prometheus histogram_quantile does.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM histograms carry no tenant, so vllm rows appear only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds: a positive multiple of 60 (the rollups hold whole minutes)
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC
-- returns: source String | gateway (measured per request at the gateway) or vllm (vLLM's own histograms)
-- returns: metric String | ttft_ms (gateway: arrival to first content chunk; vLLM: arrival at the frontend to first token) or queue_wait_ms (vLLM queue time: first queued to first scheduled)
-- returns: p50_ms Nullable(Float64) | median, ms
-- returns: p95_ms Nullable(Float64) | 95th percentile, ms
-- returns: p99_ms Nullable(Float64) | 99th percentile, ms
-- returns: samples UInt64 | requests behind the quantiles (gateway: served requests with a value, status < 400 and prompt_tokens > 0, the population the quantiles are over since migration 0048; vllm: Δ of the +Inf bucket)
--
-- Gateway: from requests_rollup's t-digest states (sql/migrations/0012; merged over minutes, pods and tenants)
-- of served requests (status < 400); queue_wait_ms only where vLLM reported it.
-- vLLM: per le, the bucket counters' increases (computed by the collector, restarts handled) summed over pods,
-- engines and the bucket's scrapes, then Prometheus histogram_quantile (promql/quantile.go bucketQuantile):
-- cumulative counts made monotonic; rank = q × count(+Inf); the first bucket whose count reaches the rank;
-- linear interpolation inside it from the previous bound (0 below the first); a rank in the +Inf bucket gives
-- the highest finite bound; NULL without a +Inf bucket, with fewer than two buckets, or with no observations.
WITH
    hist_by_le AS
    (
        SELECT
            toDateTime64(toStartOfInterval(t, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
            if(name = 'vllm:time_to_first_token_seconds_bucket', 'ttft_ms', 'queue_wait_ms') AS metric,
            if(lower(label) IN ('+inf', 'inf'), inf, toFloat64OrNull(label)) AS bound,
            sum(increase) AS cumulative_count
        FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = toUInt8({bucket_seconds:UInt32} % 3600 = 0),
                         names = ['vllm:time_to_first_token_seconds_bucket', 'vllm:request_queue_time_seconds_bucket'])
        WHERE {tenant:String} = '' AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model_name = {model:String}) AND bound IS NOT NULL
        GROUP BY bucket, metric, bound
    ),
    hist AS
    (
        SELECT
            bucket,
            metric,
            arraySort(x -> x.1, groupArray((assumeNotNull(bound), cumulative_count))) AS sorted,
            arrayMap(x -> x.1, sorted) AS bounds,
            arrayMap(i -> arrayMax(arraySlice(arrayMap(x -> x.2, sorted), 1, i)), arrayEnumerate(sorted)) AS counts,
            counts[length(counts)] AS observations,
            arrayMap(q -> q * observations, [0.5, 0.95, 0.99]) AS ranks,
            arrayMap(r -> arrayFirstIndex(c -> c >= r, counts), ranks) AS found,
            arrayMap((r, i) -> multiIf(
                i = length(counts), bounds[i - 1],
                i = 1, if(bounds[1] <= 0, bounds[1], bounds[1] * r / counts[1]),
                bounds[i - 1] + (bounds[i] - bounds[i - 1]) * (r - counts[i - 1]) / (counts[i] - counts[i - 1])),
                ranks, found) AS quantiles_seconds,
            length(bounds) >= 2 AND isInfinite(bounds[length(bounds)]) AND observations > 0 AS valid
        FROM hist_by_le
        GROUP BY bucket, metric
    ),
    gateway AS
    (
        SELECT
            toDateTime64(toStartOfInterval(t, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
            quantilesTDigestMerge(0.5, 0.95, 0.99)(ttft_ms) AS ttft,
            quantilesTDigestMerge(0.5, 0.95, 0.99)(queue_wait_ms) AS queue,
            sum(served) AS served_requests,
            sum(queue_wait_samples) AS queue_samples
        FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = toUInt8({bucket_seconds:UInt32} % 3600 = 0))
        WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
        GROUP BY bucket
    )
SELECT bucket, source, metric, p50_ms, p95_ms, p99_ms, samples
FROM
(
    SELECT bucket, 'gateway' AS source, 'ttft_ms' AS metric,
           CAST(ttft[1] AS Nullable(Float64)) AS p50_ms, CAST(ttft[2] AS Nullable(Float64)) AS p95_ms,
           CAST(ttft[3] AS Nullable(Float64)) AS p99_ms, served_requests AS samples
    FROM gateway
    WHERE served_requests > 0
    UNION ALL
    SELECT bucket, 'gateway' AS source, 'queue_wait_ms' AS metric,
           CAST(queue[1] AS Nullable(Float64)) AS p50_ms, CAST(queue[2] AS Nullable(Float64)) AS p95_ms,
           CAST(queue[3] AS Nullable(Float64)) AS p99_ms, queue_samples AS samples
    FROM gateway
    WHERE queue_samples > 0
    UNION ALL
    SELECT
        bucket, 'vllm' AS source, metric,
        if(valid, quantiles_seconds[1] * 1000, NULL) AS p50_ms,
        if(valid, quantiles_seconds[2] * 1000, NULL) AS p95_ms,
        if(valid, quantiles_seconds[3] * 1000, NULL) AS p99_ms,
        toUInt64(round(if(isFinite(observations), greatest(observations, 0), 0))) AS samples
    FROM hist
)
ORDER BY bucket, source, metric
