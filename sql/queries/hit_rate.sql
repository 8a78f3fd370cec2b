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
-- vLLM counters: the deltas of vllm_counter_deltas (sql/migrations/0006), which holds the rules: deltas
-- between consecutive samples of a series, restarts (a drop, or a change of _created: delta = the new value),
-- no delta for a series' first sample, a baseline read from one day before `since`, and the older
-- vllm:gpu_prefix_cache_* names (vLLM <= 0.11) used only where the newer ones are absent (never both).
WITH
    deltas AS
    (
        SELECT ts, name, delta
        FROM vllm_counter_deltas(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                                 pod = {pod:String},
                                 counters = ['vllm:prefix_cache_hits_total', 'vllm:prefix_cache_queries_total'])
        WHERE {tenant:String} = ''
    ),
    served AS
    (
        SELECT ts, prompt_tokens, cached_tokens
        FROM served_requests(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                             tenant = {tenant:String}, pod = {pod:String})
    )
SELECT *
FROM
(
    SELECT
        toDateTime64(toStartOfInterval(ts, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
        'vllm' AS source,
        toUInt64(round(sumIf(delta, name = 'vllm:prefix_cache_hits_total'))) AS hit_tokens,
        toUInt64(round(sumIf(delta, name = 'vllm:prefix_cache_queries_total'))) AS query_tokens,
        if(query_tokens > 0, hit_tokens / query_tokens, NULL) AS token_weighted_hit_rate,
        CAST(NULL AS Nullable(Float64)) AS request_weighted_hit_rate,
        CAST(NULL AS Nullable(UInt64)) AS requests
    FROM deltas
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
