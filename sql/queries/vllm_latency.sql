-- name: vllm_latency
-- description: vLLM's end-to-end request latency and inter-token latency p50/p95/p99 per bucket (per pod, or pods pooled), by bucket interpolation of its histograms' count deltas, as Prometheus histogram_quantile does.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM's histograms carry no tenant, so rows appear only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): vLLM's `model_name` label
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds: a positive multiple of 60 (the rollups hold whole minutes)
-- param: by_pod: UInt8 = 1 | 1 = one row per pod and bucket; 0 = pods pooled (pod '')
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC
-- returns: pod String | pod name; '' when by_pod = 0
-- returns: metric String | e2e_ms (vllm:e2e_request_latency_seconds: arrival at the frontend to the last token) or inter_token_ms (vllm:inter_token_latency_seconds: between consecutive output tokens)
-- returns: p50_ms Nullable(Float64) | median, ms
-- returns: p95_ms Nullable(Float64) | 95th percentile, ms
-- returns: p99_ms Nullable(Float64) | 99th percentile, ms
-- returns: samples UInt64 | observations behind the quantiles (Δ of the +Inf bucket): requests (e2e_ms) or token gaps (inter_token_ms)
--
-- Per le, the bucket counters' increases (computed by the collector, restarts handled) summed over engines (and
-- pods when pooled) and the bucket's scrapes, then Prometheus histogram_quantile (promql/quantile.go
-- bucketQuantile), as the latency query does: cumulative counts made monotonic; rank = q × count(+Inf); the
-- first bucket whose count reaches the rank; linear interpolation inside it from the previous bound (0 below
-- the first); a rank in the +Inf bucket gives the highest finite bound; NULL without a +Inf bucket, with fewer
-- than two buckets, or with no observations. Reads vllm_rollup (sql/migrations/0012).
WITH
    hist_by_le AS
    (
        SELECT
            toDateTime64(toStartOfInterval(t, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
            if({by_pod:UInt8} = 1, CAST(pod AS String), '') AS pod_name,
            if(name = 'vllm:e2e_request_latency_seconds_bucket', 'e2e_ms', 'inter_token_ms') AS metric,
            if(lower(label) IN ('+inf', 'inf'), inf, toFloat64OrNull(label)) AS bound,
            sum(increase) AS cumulative_count
        FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                         hourly = toUInt8({bucket_seconds:UInt32} % 3600 = 0),
                         names = ['vllm:e2e_request_latency_seconds_bucket', 'vllm:inter_token_latency_seconds_bucket'])
        WHERE {tenant:String} = '' AND ({pod:String} = '' OR pod = {pod:String})
          AND ({model:String} = '' OR model_name = {model:String}) AND bound IS NOT NULL
        GROUP BY bucket, pod_name, metric, bound
    ),
    hist AS
    (
        SELECT
            bucket,
            pod_name,
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
        GROUP BY bucket, pod_name, metric
    )
SELECT
    bucket,
    pod_name AS pod,
    metric,
    CAST(if(valid, quantiles_seconds[1] * 1000, NULL) AS Nullable(Float64)) AS p50_ms,
    CAST(if(valid, quantiles_seconds[2] * 1000, NULL) AS Nullable(Float64)) AS p95_ms,
    CAST(if(valid, quantiles_seconds[3] * 1000, NULL) AS Nullable(Float64)) AS p99_ms,
    toUInt64(round(if(isFinite(observations), greatest(observations, 0), 0))) AS samples
FROM hist
WHERE observations > 0
ORDER BY bucket, pod, metric
