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
-- vLLM counters: the deltas of vllm_counter_deltas (sql/migrations/0006: a drop or a change of the counter's
-- _created sample is a restart, the first sample of a series contributes nothing). vllm:prompt_tokens_total
-- counts a prompt when its prefill finishes, the gateway when the response arrives: short buckets can differ.
WITH
    served AS
    (
        SELECT ts, prompt_tokens AS request_prompt_tokens, cached_tokens AS request_cached_tokens,
               completion_tokens AS request_completion_tokens
        FROM served_requests(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                             tenant = {tenant:String}, pod = {pod:String})
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
        toUInt64(round(sumIf(delta, name = 'vllm:prompt_tokens_total'))) AS prompt_tokens,
        CAST(NULL AS Nullable(UInt64)) AS cached_tokens,
        CAST(NULL AS Nullable(UInt64)) AS prefill_computed_tokens,
        toUInt64(round(sumIf(delta, name = 'vllm:generation_tokens_total'))) AS decode_tokens
    FROM vllm_counter_deltas(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                             pod = {pod:String},
                             counters = ['vllm:prompt_tokens_total', 'vllm:generation_tokens_total'])
    WHERE {tenant:String} = ''
    GROUP BY bucket
)
ORDER BY bucket, source
