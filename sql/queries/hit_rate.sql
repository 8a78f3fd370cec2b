-- name: hit_rate
-- description: Token-weighted prefix-cache hit rate per time bucket, from vLLM's counters and from the gateway log side by side (a disagreement is itself a finding), with the request-weighted hit rate beside the gateway's to expose the gap.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM counters carry no tenant, so vllm rows appear only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC (vllm: bucket of the later scrape of each counter delta; gateway: of the request's arrival)
-- returns: source String | vllm (Δ vllm:prefix_cache_hits_total / Δ vllm:prefix_cache_queries_total) or gateway (cached_tokens / prompt_tokens)
-- returns: hit_tokens UInt64 | prefix_cache_hit_tokens, tokens served from the prefix cache
-- returns: query_tokens UInt64 | prompt tokens looked up (vllm) or prompt tokens of served requests (gateway), tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | hit_tokens / query_tokens, fraction 0..1 (ratio of sums over pods and engines); NULL when query_tokens = 0
-- returns: request_weighted_hit_rate Nullable(Float64) | mean over served requests of cached/prompt, fraction 0..1; NULL for vllm
-- returns: requests Nullable(UInt64) | served requests (status < 400, prompt_tokens > 0); NULL for vllm
--
-- vLLM counters: one series per (metric, pod, engine, labels). A delta is taken between consecutive samples
-- of a series (lagInFrame over ts); a drop, or a change of the counter's _created sample, is a restart, and
-- the delta is then the new value; the first sample of a series contributes no delta. Samples are read from
-- one day before `since` so the first bucket has its baseline. Older vLLM (<= 0.11) exposes
-- vllm:gpu_prefix_cache_*; 0.10 exposes both generations with equal values, so at each scrape of a
-- (pod, engine) the older names are used only when the newer ones are absent (never both: no double count).
-- Duplicate samples (a re-sent scrape not yet merged) repeat a value and add a zero delta, so no FINAL here.
WITH
    counters AS
    (
        SELECT
            pod,
            engine,
            toString(mapSort(labels)) AS series_labels,
            ts,
            value,
            if(endsWith(name, '_hits_total'), 'hits', 'queries') AS kind,
            if(startsWith(name, 'vllm:gpu_'), 0, 1) AS generation,
            replaceRegexpOne(name, '_total$', '_created') AS created_name,
            max(generation) OVER (PARTITION BY pod, engine, ts) AS newest_generation
        FROM vllm_metric_samples
        WHERE name IN ('vllm:prefix_cache_hits_total', 'vllm:prefix_cache_queries_total',
                       'vllm:gpu_prefix_cache_hits_total', 'vllm:gpu_prefix_cache_queries_total')
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
        WHERE name IN ('vllm:prefix_cache_hits_created', 'vllm:prefix_cache_queries_created',
                       'vllm:gpu_prefix_cache_hits_created', 'vllm:gpu_prefix_cache_queries_created')
          AND ts >= {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY
          AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY created_name, pod, engine, series_labels, ts
    ),
    samples AS
    (
        SELECT c.pod AS pod, c.engine AS engine, c.series_labels AS series_labels, c.ts AS ts,
               c.value AS value, c.kind AS kind, c.generation AS generation, cr.created AS created
        FROM counters AS c
        LEFT JOIN created AS cr
            ON c.created_name = cr.created_name AND c.pod = cr.pod AND c.engine = cr.engine
           AND c.series_labels = cr.series_labels AND c.ts = cr.ts
        WHERE c.generation = c.newest_generation
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
        WINDOW w AS (PARTITION BY kind, generation, pod, engine, series_labels ORDER BY ts
                     ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
    ),
    served AS
    (
        SELECT ts, prompt_tokens, cached_tokens
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
        'vllm' AS source,
        toUInt64(round(sumIf(delta, kind = 'hits'))) AS hit_tokens,
        toUInt64(round(sumIf(delta, kind = 'queries'))) AS query_tokens,
        if(query_tokens > 0, hit_tokens / query_tokens, NULL) AS token_weighted_hit_rate,
        CAST(NULL AS Nullable(Float64)) AS request_weighted_hit_rate,
        CAST(NULL AS Nullable(UInt64)) AS requests
    FROM deltas
    WHERE ts >= {since:DateTime64(3, 'UTC')} AND NOT is_first
    GROUP BY bucket
    UNION ALL
    SELECT
        toDateTime64(toStartOfInterval(ts, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
        'gateway' AS source,
        sum(toUInt64(cached_tokens)) AS hit_tokens,
        sum(toUInt64(prompt_tokens)) AS query_tokens,
        if(query_tokens > 0, hit_tokens / query_tokens, NULL) AS token_weighted_hit_rate,
        CAST(avg(cached_tokens / prompt_tokens) AS Nullable(Float64)) AS request_weighted_hit_rate,
        CAST(count() AS Nullable(UInt64)) AS requests
    FROM served
    GROUP BY bucket
)
ORDER BY bucket, source
