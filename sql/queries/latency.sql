-- name: latency
-- description: ttft_ms and queue_wait_ms p50/p95/p99 per bucket: exact quantiles over the gateway's requests, and from vLLM's histograms (vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds) by bucket interpolation of the count deltas, as Prometheus histogram_quantile does.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM histograms carry no tenant, so vllm rows appear only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC
-- returns: source String | gateway (measured per request at the gateway) or vllm (vLLM's own histograms)
-- returns: metric String | ttft_ms (gateway: arrival to first content chunk; vLLM: arrival at the frontend to first token) or queue_wait_ms (vLLM queue time: first queued to first scheduled)
-- returns: p50_ms Nullable(Float64) | median, ms
-- returns: p95_ms Nullable(Float64) | 95th percentile, ms
-- returns: p99_ms Nullable(Float64) | 99th percentile, ms
-- returns: samples UInt64 | requests behind the quantiles (gateway: served requests with a value; vllm: Δ of the +Inf bucket)
--
-- Gateway: quantilesExactInclusive (linear interpolation between order statistics, numpy's default) over
-- served requests (status < 400); queue_wait_ms only where vLLM reported it.
-- vLLM: per series (pod, engine, labels incl. le) the count delta between consecutive scrapes, from
-- vllm_counter_deltas (sql/migrations/0006: a drop is a restart, delta = the new value; the first sample
-- contributes nothing), summed per le over pods and engines, then Prometheus histogram_quantile
-- (promql/quantile.go bucketQuantile): cumulative counts made monotonic; rank = q × count(+Inf); the first
-- bucket whose count reaches the rank; linear interpolation inside it from the previous bound (0 below the
-- first); a rank in the +Inf bucket returns the highest finite bound; NULL without a +Inf bucket, with
-- fewer than two buckets, or with no observations.
WITH
    gateway AS
    (
        SELECT
            toDateTime64(toStartOfInterval(ts, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
            ttft_ms,
            queue_wait_ms
        FROM gateway_requests
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({tenant:String} = '' OR tenant_id = {tenant:String})
          AND ({pod:String} = '' OR pod = {pod:String})
          AND status < 400
    ),
    hist_deltas AS
    (
        SELECT
            ts,
            if(name = 'vllm:time_to_first_token_seconds_bucket', 'ttft_ms', 'queue_wait_ms') AS metric,
            if(lower(le) IN ('+inf', 'inf'), inf, toFloat64OrNull(le)) AS bound,
            delta
        FROM vllm_counter_deltas(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                                 pod = {pod:String},
                                 counters = ['vllm:time_to_first_token_seconds_bucket',
                                             'vllm:request_queue_time_seconds_bucket'])
        WHERE {tenant:String} = ''
    ),
    hist_by_le AS
    (
        SELECT
            toDateTime64(toStartOfInterval(ts, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
            metric,
            assumeNotNull(bound) AS upper_bound,
            sum(delta) AS cumulative_count
        FROM hist_deltas
        WHERE bound IS NOT NULL
        GROUP BY bucket, metric, upper_bound
    ),
    hist AS
    (
        SELECT
            bucket,
            metric,
            arraySort(x -> x.1, groupArray((upper_bound, cumulative_count))) AS sorted,
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
    )
SELECT bucket, source, metric, p50_ms, p95_ms, p99_ms, samples
FROM
(
    SELECT
        bucket, 'gateway' AS source, 'ttft_ms' AS metric,
        quantilesExactInclusive(0.5, 0.95, 0.99)(ttft_ms) AS q,
        CAST(q[1] AS Nullable(Float64)) AS p50_ms,
        CAST(q[2] AS Nullable(Float64)) AS p95_ms,
        CAST(q[3] AS Nullable(Float64)) AS p99_ms,
        count() AS samples
    FROM gateway
    GROUP BY bucket
    UNION ALL
    SELECT
        bucket, 'gateway' AS source, 'queue_wait_ms' AS metric,
        quantilesExactInclusive(0.5, 0.95, 0.99)(assumeNotNull(queue_wait_ms)) AS q,
        CAST(q[1] AS Nullable(Float64)) AS p50_ms,
        CAST(q[2] AS Nullable(Float64)) AS p95_ms,
        CAST(q[3] AS Nullable(Float64)) AS p99_ms,
        count() AS samples
    FROM gateway
    WHERE queue_wait_ms IS NOT NULL
    GROUP BY bucket
    UNION ALL
    SELECT
        bucket, 'vllm' AS source, metric,
        quantiles_seconds AS q,
        if(valid, q[1] * 1000, NULL) AS p50_ms,
        if(valid, q[2] * 1000, NULL) AS p95_ms,
        if(valid, q[3] * 1000, NULL) AS p99_ms,
        toUInt64(round(if(isFinite(observations), greatest(observations, 0), 0))) AS samples
    FROM hist
)
ORDER BY bucket, source, metric
