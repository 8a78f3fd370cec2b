-- name: tokens
-- description: Prefill vs decode tokens per bucket: from the gateway (prompt tokens split into cached and computed prefill, completion tokens) and from vLLM's counters (Δ vllm:prompt_tokens_total, Δ vllm:generation_tokens_total).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM counters carry no tenant, so vllm rows appear only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds: a positive multiple of 60 (the rollups hold whole minutes)
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC
-- returns: source String | gateway (per-request usage) or vllm (counter deltas)
-- returns: requests Nullable(UInt64) | served requests (status < 400, prompt_tokens > 0); NULL for vllm
-- returns: prompt_tokens UInt64 | prefill_tokens_total: all prompt tokens, cached ones included, tokens
-- returns: cached_tokens Nullable(UInt64) | prefix_cache_hit_tokens: prompt tokens served from the prefix cache, of the requests whose cached count is known, tokens; NULL for vllm (see hit_rate for vLLM's hit counters)
-- returns: prefill_computed_tokens Nullable(UInt64) | prefix_cache_miss_tokens: prompt tokens the pod computed: prompt - cached of the requests whose cached count is known, plus every prompt token of the requests that read no prefix cache (prompt logprobs: skip_reading_prefix_cache), tokens; NULL for vllm
-- returns: decode_tokens UInt64 | decode_tokens_total: completion (generated) tokens, tokens
-- returns: cached_tokens_coverage Nullable(Float64) | prompt tokens of the requests whose cached count is known / prompt_tokens, fraction 0..1; NULL for vllm
--
-- Reads the rollups (sql/migrations/0012, 0014): exact sums at minute resolution, whole hours from the hour tables.
-- vLLM: the counter increases the collector computed between consecutive scrapes of each series (restarts
-- handled there; docs/scale.md), stamped at the later scrape; older vLLM's vllm:gpu_prefix_cache_* names are
-- read too (the collector keeps only one generation per scrape).
-- vllm:prompt_tokens_total counts a prompt when its prefill finishes, the gateway when the response arrives:
-- short buckets can differ.
SELECT *
FROM
(
    SELECT
        toDateTime64(toStartOfInterval(t, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
        'gateway' AS source,
        CAST(sum(r.served) AS Nullable(UInt64)) AS requests,
        sum(r.prompt_tokens) AS prompt_tokens,
        CAST(sum(r.cached_tokens) AS Nullable(UInt64)) AS cached_tokens,
        CAST(sum(r.known_prompt_tokens) - sum(r.cached_tokens) + sum(r.skipped_prompt_tokens) AS Nullable(UInt64))
            AS prefill_computed_tokens,
        sum(r.completion_tokens) AS decode_tokens,
        if(sum(r.prompt_tokens) > 0, sum(r.known_prompt_tokens) / sum(r.prompt_tokens), NULL) AS cached_tokens_coverage
    FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = toUInt8({bucket_seconds:UInt32} % 3600 = 0)) AS r
    WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
    GROUP BY bucket
    HAVING sum(r.served) > 0
    UNION ALL
    SELECT
        toDateTime64(toStartOfInterval(t, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
        'vllm' AS source,
        CAST(NULL AS Nullable(UInt64)) AS requests,
        toUInt64(round(sumIf(increase, name = 'vllm:prompt_tokens_total'))) AS prompt_tokens,
        CAST(NULL AS Nullable(UInt64)) AS cached_tokens,
        CAST(NULL AS Nullable(UInt64)) AS prefill_computed_tokens,
        toUInt64(round(sumIf(increase, name = 'vllm:generation_tokens_total'))) AS decode_tokens,
        CAST(NULL AS Nullable(Float64)) AS cached_tokens_coverage
    FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = toUInt8({bucket_seconds:UInt32} % 3600 = 0), names = ['vllm:prompt_tokens_total', 'vllm:generation_tokens_total'])
    WHERE {tenant:String} = '' AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model_name = {model:String})
    GROUP BY bucket
)
ORDER BY bucket, source
