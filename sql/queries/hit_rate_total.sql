-- name: hit_rate_total
-- description: Token-weighted prefix-cache hit rate over the whole window, one row per source (vllm counters, gateway log): the numbers to compare with what the servers report; same rules as hit_rate, without buckets.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM counters carry no tenant, so the vllm row appears only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- returns: source String | vllm (Δ vllm:prefix_cache_hits_total / Δ vllm:prefix_cache_queries_total) or gateway (cached_tokens / prompt_tokens)
-- returns: hit_tokens UInt64 | prefix_cache_hit_tokens, tokens served from the prefix cache
-- returns: query_tokens UInt64 | prompt tokens looked up (vllm) or prompt tokens of served requests (gateway), tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | hit_tokens / query_tokens, fraction 0..1 (ratio of sums over pods and engines); NULL when query_tokens = 0
-- returns: request_weighted_hit_rate Nullable(Float64) | mean over served requests of cached/prompt, fraction 0..1; NULL for vllm
-- returns: requests Nullable(UInt64) | served requests (status < 400, prompt_tokens > 0); NULL for vllm
--
-- The vllm row sums the counter deltas of every series whose later sample falls in the window (see
-- vllm_counter_deltas in sql/migrations/0006 for the delta, reset and name-generation rules).
-- A source without data in the window has no row.
WITH
    deltas AS
    (
        SELECT name, delta
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
        'vllm' AS source,
        toUInt64(round(sumIf(delta, name = 'vllm:prefix_cache_hits_total'))) AS hit_tokens,
        toUInt64(round(sumIf(delta, name = 'vllm:prefix_cache_queries_total'))) AS query_tokens,
        if(query_tokens > 0, hit_tokens / query_tokens, NULL) AS token_weighted_hit_rate,
        CAST(NULL AS Nullable(Float64)) AS request_weighted_hit_rate,
        CAST(NULL AS Nullable(UInt64)) AS requests
    FROM deltas
    HAVING count() > 0
    UNION ALL
    SELECT
        'gateway' AS source,
        sum(toUInt64(cached_tokens)) AS hit_tokens,
        sum(toUInt64(prompt_tokens)) AS query_tokens,
        if(query_tokens > 0, hit_tokens / query_tokens, NULL) AS token_weighted_hit_rate,
        CAST(avg(cached_tokens / prompt_tokens) AS Nullable(Float64)) AS request_weighted_hit_rate,
        CAST(count() AS Nullable(UInt64)) AS requests
    FROM served
    HAVING count() > 0
)
ORDER BY source
