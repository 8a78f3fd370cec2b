-- name: tokens
-- description: Prefill vs decode tokens per bucket: from the gateway (prompt tokens split into cached and computed prefill, completion tokens) and from vLLM's counters (Δ vllm:prompt_tokens_total, Δ vllm:generation_tokens_total).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM counters carry no tenant, so vllm rows appear only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC
-- returns: source String | gateway (per-request usage) or vllm (counter deltas)
-- returns: requests Nullable(UInt64) | served requests (status < 400, prompt_tokens > 0); NULL for vllm
-- returns: prompt_tokens UInt64 | prefill_tokens_total: all prompt tokens, cached ones included, tokens
-- returns: cached_tokens Nullable(UInt64) | prefix_cache_hit_tokens: prompt tokens served from the prefix cache, tokens; NULL for vllm (see hit_rate for vLLM's hit counters)
-- returns: prefill_computed_tokens Nullable(UInt64) | prefix_cache_miss_tokens: prompt tokens the pod computed (prompt - cached), tokens; NULL for vllm
-- returns: decode_tokens UInt64 | decode_tokens_total: completion (generated) tokens, tokens
--
-- vLLM counters: deltas per series between consecutive samples; a drop or a change of the counter's
-- _created sample is a restart (delta = the new value); the first sample of a series contributes nothing
-- (same rules as hit_rate.sql). vllm:prompt_tokens_total counts a prompt when its prefill finishes, the
-- gateway when the response arrives: short buckets can differ.
WITH
    counters AS
    (
        SELECT
            pod,
            engine,
            toString(mapSort(labels)) AS series_labels,
            ts,
            value,
            if(name = 'vllm:prompt_tokens_total', 'prompt', 'generation') AS kind,
            replaceRegexpOne(name, '_total$', '_created') AS created_name
        FROM vllm_metric_samples
        WHERE name IN ('vllm:prompt_tokens_total', 'vllm:generation_tokens_total')
          AND ts >= {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY
          AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
          AND {tenant:String} = ''
    ),
    created AS
    (
        SELECT name AS created_name, pod, engine, toString(mapSort(labels)) AS series_labels, ts,
               max(value) AS created
        FROM vllm_metric_samples
        WHERE name IN ('vllm:prompt_tokens_created', 'vllm:generation_tokens_created')
          AND ts >= {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY
          AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY created_name, pod, engine, series_labels, ts
    ),
    samples AS
    (
        SELECT c.pod AS pod, c.engine AS engine, c.series_labels AS series_labels, c.ts AS ts,
               c.value AS value, c.kind AS kind, cr.created AS created
        FROM counters AS c
        LEFT JOIN created AS cr
            ON c.created_name = cr.created_name AND c.pod = cr.pod AND c.engine = cr.engine
           AND c.series_labels = cr.series_labels AND c.ts = cr.ts
    ),
    deltas AS
    (
        SELECT
            ts,
            kind,
            row_number() OVER w = 1 AS is_first,
            if(value < lagInFrame(value) OVER w
                   OR (created > 0 AND lagInFrame(created) OVER w > 0 AND created != lagInFrame(created) OVER w),
               value,
               value - lagInFrame(value) OVER w) AS delta
        FROM samples
        WINDOW w AS (PARTITION BY kind, pod, engine, series_labels ORDER BY ts
                     ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
    ),
    served AS
    (
        SELECT ts, prompt_tokens AS request_prompt_tokens, cached_tokens AS request_cached_tokens,
               completion_tokens AS request_completion_tokens
        FROM gateway_requests FINAL
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({tenant:String} = '' OR tenant_id = {tenant:String})
          AND ({pod:String} = '' OR pod = {pod:String})
          AND status < 400 AND prompt_tokens > 0
    )
SELECT *
FROM
(
    SELECT
        toDateTime64(toStartOfInterval(ts, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
        'gateway' AS source,
        CAST(count() AS Nullable(UInt64)) AS requests,
        sum(toUInt64(request_prompt_tokens)) AS prompt_tokens,
        CAST(sum(toUInt64(request_cached_tokens)) AS Nullable(UInt64)) AS cached_tokens,
        CAST(sum(toUInt64(greatest(toInt64(request_prompt_tokens) - toInt64(request_cached_tokens), 0)))
             AS Nullable(UInt64)) AS prefill_computed_tokens,
        sum(toUInt64(request_completion_tokens)) AS decode_tokens
    FROM served
    GROUP BY bucket
    UNION ALL
    SELECT
        toDateTime64(toStartOfInterval(ts, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
        'vllm' AS source,
        CAST(NULL AS Nullable(UInt64)) AS requests,
        toUInt64(round(sumIf(delta, kind = 'prompt'))) AS prompt_tokens,
        CAST(NULL AS Nullable(UInt64)) AS cached_tokens,
        CAST(NULL AS Nullable(UInt64)) AS prefill_computed_tokens,
        toUInt64(round(sumIf(delta, kind = 'generation'))) AS decode_tokens
    FROM deltas
    WHERE ts >= {since:DateTime64(3, 'UTC')} AND NOT is_first
    GROUP BY bucket
)
ORDER BY bucket, source
