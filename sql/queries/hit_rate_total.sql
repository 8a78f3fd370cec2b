-- name: hit_rate_total
-- description: Token-weighted prefix-cache hit rate over the whole window, one row per source (vllm counters, gateway log): the numbers to compare with what the servers report; same rules as hit_rate, without buckets.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM counters carry no tenant, so the vllm row appears only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: source String | vllm (Δ vllm:prefix_cache_hits_total / Δ vllm:prefix_cache_queries_total) or gateway (cached_tokens / prompt_tokens over the requests whose cached count is known)
-- returns: hit_tokens UInt64 | prefix_cache_hit_tokens, tokens served from the prefix cache
-- returns: query_tokens UInt64 | prompt tokens looked up (vllm) or prompt tokens of served requests whose cached count is known (gateway), tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | hit_tokens / query_tokens, fraction 0..1 (ratio of sums over pods and engines); NULL when query_tokens = 0
-- returns: request_weighted_hit_rate Nullable(Float64) | mean over served requests with a known cached count of cached/prompt, fraction 0..1; NULL for vllm
-- returns: requests Nullable(UInt64) | served requests (status < 400, prompt_tokens > 0), known cached count or not; NULL for vllm
-- returns: cached_tokens_coverage Nullable(Float64) | prompt tokens of served requests whose cached count the pod reported / all their prompt tokens, fraction 0..1 (the share the hit rate covers); NULL for vllm
--
-- Reads the rollups (sql/migrations/0012, 0014): exact sums at minute resolution, whole hours from the hour tables.
-- vLLM: the counter increases the collector computed between consecutive scrapes of each series (restarts
-- handled there; docs/scale.md), stamped at the later scrape; older vLLM's vllm:gpu_prefix_cache_* names are
-- read too (the collector keeps only one generation per scrape).
-- A source without data in the window has no row.
SELECT *
FROM
(
    SELECT
        'vllm' AS source,
        toUInt64(round(sumIf(increase, name IN ('vllm:prefix_cache_hits_total', 'vllm:gpu_prefix_cache_hits_total')))) AS hit_tokens,
        toUInt64(round(sumIf(increase, name IN ('vllm:prefix_cache_queries_total', 'vllm:gpu_prefix_cache_queries_total')))) AS query_tokens,
        if(query_tokens > 0, hit_tokens / query_tokens, NULL) AS token_weighted_hit_rate,
        CAST(NULL AS Nullable(Float64)) AS request_weighted_hit_rate,
        CAST(NULL AS Nullable(UInt64)) AS requests,
        CAST(NULL AS Nullable(Float64)) AS cached_tokens_coverage
    FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1, names = ['vllm:prefix_cache_hits_total', 'vllm:gpu_prefix_cache_hits_total', 'vllm:prefix_cache_queries_total', 'vllm:gpu_prefix_cache_queries_total'])
    WHERE {tenant:String} = '' AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model_name = {model:String})
    HAVING count() > 0
    UNION ALL
    SELECT
        'gateway' AS source,
        sum(cached_tokens) AS hit_tokens,
        sum(known_prompt_tokens) AS query_tokens,
        if(query_tokens > 0, hit_tokens / query_tokens, NULL) AS token_weighted_hit_rate,
        if(sum(known_served) > 0, sum(hit_ratio_sum) / sum(known_served), NULL) AS request_weighted_hit_rate,
        CAST(sum(served) AS Nullable(UInt64)) AS requests,
        if(sum(prompt_tokens) > 0, sum(known_prompt_tokens) / sum(prompt_tokens), NULL) AS cached_tokens_coverage
    FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
    WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
    HAVING sum(served) > 0
)
ORDER BY source
