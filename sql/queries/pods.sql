-- name: pods
-- description: Per pod: served requests and the token-weighted hit rate from the gateway beside vLLM's own (counter deltas), KV cache usage (latest), and the cache configuration vLLM reports (block size, prefix caching on, hash algorithm, bytes per cached token).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; with a tenant, only pods that served it are listed and the vllm_* columns are NULL (counters carry no tenant)
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: pod String | pod name (gateway log `pod` = the collector's pod name for the scrape target)
-- returns: requests UInt64 | served requests (status < 400, prompt_tokens > 0)
-- returns: errors UInt64 | requests the gateway answered with status >= 400
-- returns: prompt_tokens UInt64 | Σ prompt tokens of served requests, tokens
-- returns: cached_tokens UInt64 | Σ cached tokens (prefix_cache_hit_tokens) of the requests whose cached count is known, tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | cached_tokens / prompt tokens of the requests whose cached count is known (gateway), fraction 0..1
-- returns: cached_tokens_coverage Nullable(Float64) | prompt tokens of served requests whose cached count the pod reported / prompt_tokens, fraction 0..1 (the share the hit rate covers)
-- returns: vllm_hit_tokens Nullable(UInt64) | Δ vllm:prefix_cache_hits_total summed over engines, tokens
-- returns: vllm_query_tokens Nullable(UInt64) | Δ vllm:prefix_cache_queries_total summed over engines, tokens
-- returns: vllm_token_weighted_hit_rate Nullable(Float64) | vllm_hit_tokens / vllm_query_tokens, fraction 0..1
-- returns: kv_cache_usage Nullable(Float64) | vllm:kv_cache_usage_perc (older: vllm:gpu_cache_usage_perc), latest sample in the window, mean over the pod's series (engines; replicas a proxy tells apart by a label of its own), fraction 0..1 of KV blocks held by running requests (cached free blocks count as free)
-- returns: engines UInt64 | distinct engine labels (data-parallel ranks) on vLLM's series in the window (1 when none carries the label, as in vLLM V0)
-- returns: block_size Nullable(UInt32) | vllm:cache_config_info block_size label, tokens per KV block
-- returns: enable_prefix_caching String | vllm:cache_config_info label ('' if not scraped)
-- returns: prefix_caching_hash_algo String | vllm:cache_config_info label ('' if not scraped)
-- returns: bytes_per_token Nullable(Float64) | kv_cache_memory_bytes / kv_cache_size_tokens from vllm:cache_config_info (vLLM >= 0.32), bytes per cached token
-- returns: last_scrape_ts Nullable(DateTime64(3, 'UTC')) | latest vLLM sample of the pod in the window, UTC
--
-- Reads requests_rollup and vllm_rollup (sql/migrations/0012, 0014; vLLM counter increases computed by the collector,
-- restarts handled, both name generations read) and vllm_cache_config (the latest labels up to `until`).
WITH
    served AS
    (
        SELECT CAST(pod AS String) AS pod_name, sum(r.served) AS requests, sum(r.errors) AS errors,
               sum(r.prompt_tokens) AS prompt_tokens_sum, sum(r.cached_tokens) AS cached_tokens_sum,
               sum(r.known_prompt_tokens) AS known_prompt_sum
        FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1) AS r
        WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
        GROUP BY pod_name
    ),
    series AS
    (
        SELECT CAST(pod AS String) AS pod_name,
               CAST(toUInt64(round(sumIf(increase, name IN ('vllm:prefix_cache_hits_total',
                                                             'vllm:gpu_prefix_cache_hits_total'))))
                    AS Nullable(UInt64)) AS hit_tokens,
               CAST(toUInt64(round(sumIf(increase, name IN ('vllm:prefix_cache_queries_total',
                                                             'vllm:gpu_prefix_cache_queries_total'))))
                    AS Nullable(UInt64)) AS query_tokens,
               greatest(uniqExactIf(engine, engine != ''), toUInt64(count() > 0)) AS engines,
               CAST(max(last_ts) AS Nullable(DateTime64(3, 'UTC'))) AS last_scrape_ts
        FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1,
                         names = ['vllm:prefix_cache_hits_total', 'vllm:gpu_prefix_cache_hits_total',
                                  'vllm:prefix_cache_queries_total', 'vllm:gpu_prefix_cache_queries_total',
                                  'vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc',
                                  'vllm:num_requests_running'])
        WHERE {tenant:String} = '' AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model_name = {model:String})
        GROUP BY pod_name
    ),
    usage AS
    (
        SELECT pod_name, CAST(avg(latest) AS Nullable(Float64)) AS kv_cache_usage
        FROM
        (
            SELECT CAST(pod AS String) AS pod_name, engine, label, argMaxMerge(last_value) AS latest
            FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1, names = ['vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc'])
            WHERE {tenant:String} = '' AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model_name = {model:String})
            GROUP BY pod_name, engine, label
        )
        GROUP BY pod_name
    ),
    config AS
    (
        SELECT CAST(pod AS String) AS pod_name, argMax(labels, ts) AS config_labels,
               argMax(block_size, ts) AS config_block_size, argMax(bytes_per_token, ts) AS config_bytes_per_token
        FROM vllm_cache_config
        WHERE ts < {until:DateTime64(3, 'UTC')} AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name
    ),
    pod_names AS
    (
        SELECT pod_name FROM served WHERE requests + errors > 0
        UNION DISTINCT
        SELECT pod_name FROM series WHERE {tenant:String} = ''
    )
SELECT
    p.pod_name AS pod,
    s.requests AS requests,
    s.errors AS errors,
    s.prompt_tokens_sum AS prompt_tokens,
    s.cached_tokens_sum AS cached_tokens,
    if(s.known_prompt_sum > 0, s.cached_tokens_sum / s.known_prompt_sum, NULL) AS token_weighted_hit_rate,
    if(s.prompt_tokens_sum > 0, s.known_prompt_sum / s.prompt_tokens_sum, NULL) AS cached_tokens_coverage,
    c.hit_tokens AS vllm_hit_tokens,
    c.query_tokens AS vllm_query_tokens,
    if(c.query_tokens > 0, c.hit_tokens / c.query_tokens, NULL) AS vllm_token_weighted_hit_rate,
    u.kv_cache_usage AS kv_cache_usage,
    c.engines AS engines,
    if(cf.config_block_size > 0, CAST(cf.config_block_size AS Nullable(UInt32)), NULL) AS block_size,
    cf.config_labels['enable_prefix_caching'] AS enable_prefix_caching,
    cf.config_labels['prefix_caching_hash_algo'] AS prefix_caching_hash_algo,
    if(toFloat64OrZero(cf.config_labels['kv_cache_size_tokens']) > 0, cf.config_bytes_per_token, NULL)
        AS bytes_per_token,
    c.last_scrape_ts AS last_scrape_ts
FROM pod_names AS p
LEFT JOIN served AS s ON p.pod_name = s.pod_name
LEFT JOIN series AS c ON p.pod_name = c.pod_name
LEFT JOIN usage AS u ON p.pod_name = u.pod_name
LEFT JOIN config AS cf ON p.pod_name = cf.pod_name
ORDER BY pod
