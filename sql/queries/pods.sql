-- name: pods
-- description: Per pod: served requests and the token-weighted hit rate from the gateway beside vLLM's own (counter deltas), KV cache usage (latest), and the cache configuration vLLM reports (block size, prefix caching on, hash algorithm, bytes per cached token).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; with a tenant, only pods that served it are listed and the vllm_* columns are NULL (counters carry no tenant)
-- param: pod: String = '' | pod to keep, '' = all
-- returns: pod String | pod name (gateway log `pod` = the collector's pod name for the scrape target)
-- returns: requests UInt64 | served requests (status < 400, prompt_tokens > 0)
-- returns: errors UInt64 | requests the gateway answered with status >= 400
-- returns: prompt_tokens UInt64 | Σ prompt tokens of served requests, tokens
-- returns: cached_tokens UInt64 | Σ cached tokens (prefix_cache_hit_tokens), tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | cached_tokens / prompt_tokens (gateway), fraction 0..1
-- returns: vllm_hit_tokens Nullable(UInt64) | Δ vllm:prefix_cache_hits_total summed over engines, tokens
-- returns: vllm_query_tokens Nullable(UInt64) | Δ vllm:prefix_cache_queries_total summed over engines, tokens
-- returns: vllm_token_weighted_hit_rate Nullable(Float64) | vllm_hit_tokens / vllm_query_tokens, fraction 0..1
-- returns: kv_cache_usage Nullable(Float64) | vllm:kv_cache_usage_perc (older: vllm:gpu_cache_usage_perc), latest sample in the window, mean over engines, fraction 0..1 of KV blocks held by running requests (cached free blocks count as free)
-- returns: engines UInt64 | distinct engine labels (data-parallel ranks) on vllm: samples in the window (1 when none carries the label, as in vLLM V0)
-- returns: block_size Nullable(UInt32) | vllm:cache_config_info block_size label, tokens per KV block
-- returns: enable_prefix_caching String | vllm:cache_config_info label ('' if not scraped)
-- returns: prefix_caching_hash_algo String | vllm:cache_config_info label ('' if not scraped)
-- returns: bytes_per_token Nullable(Float64) | kv_cache_memory_bytes / kv_cache_size_tokens from vllm:cache_config_info (vLLM >= 0.32), bytes per cached token
-- returns: last_scrape_ts Nullable(DateTime64(3, 'UTC')) | latest vLLM sample of the pod in the window, UTC
--
-- vllm_* columns: counter deltas from vllm_counter_deltas (sql/migrations/0006: resets, first samples, name
-- generations), summed per pod.
WITH
    served AS
    (
        SELECT CAST(pod AS String) AS pod_name,
               countIf(status < 400 AND prompt_tokens > 0) AS requests,
               countIf(status >= 400) AS errors,
               sumIf(toUInt64(prompt_tokens), status < 400) AS prompt_tokens_sum,
               sumIf(toUInt64(cached_tokens), status < 400) AS cached_tokens_sum
        FROM gateway_requests
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({tenant:String} = '' OR tenant_id = {tenant:String})
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name
    ),
    counted AS
    (
        SELECT CAST(pod AS String) AS pod_name,
               CAST(toUInt64(round(sumIf(delta, name = 'vllm:prefix_cache_hits_total'))) AS Nullable(UInt64))
                   AS hit_tokens,
               CAST(toUInt64(round(sumIf(delta, name = 'vllm:prefix_cache_queries_total'))) AS Nullable(UInt64))
                   AS query_tokens
        FROM vllm_counter_deltas(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                                 pod = {pod:String},
                                 counters = ['vllm:prefix_cache_hits_total', 'vllm:prefix_cache_queries_total'])
        WHERE {tenant:String} = ''
        GROUP BY pod_name
    ),
    scraped AS
    (
        SELECT CAST(pod AS String) AS pod_name,
               -- engine '' (vLLM V0, or metrics without the label) counts only when no sample has one
               greatest(uniqExactIf(engine, startsWith(name, 'vllm:') AND engine != ''),
                        toUInt64(countIf(startsWith(name, 'vllm:')) > 0)) AS engines,
               CAST(max(ts) AS Nullable(DateTime64(3, 'UTC'))) AS last_scrape_ts
        FROM vllm_metric_samples
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name
    ),
    usage AS
    (
        SELECT pod_name, CAST(avg(latest) AS Nullable(Float64)) AS kv_cache_usage
        FROM
        (
            SELECT CAST(pod AS String) AS pod_name, engine, argMax(value, ts) AS latest
            FROM vllm_metric_samples
            WHERE name IN ('vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc')
              AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
              AND ({pod:String} = '' OR pod = {pod:String})
            GROUP BY pod_name, engine
        )
        GROUP BY pod_name
    ),
    config AS
    (
        SELECT CAST(pod AS String) AS pod_name, argMax(labels, ts) AS config_labels
        FROM vllm_metric_samples
        WHERE name = 'vllm:cache_config_info'
          AND ts >= {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name
    ),
    pod_names AS
    (
        SELECT pod_name FROM served
        UNION DISTINCT
        SELECT pod_name FROM scraped WHERE {tenant:String} = ''
    )
SELECT
    p.pod_name AS pod,
    s.requests AS requests,
    s.errors AS errors,
    s.prompt_tokens_sum AS prompt_tokens,
    s.cached_tokens_sum AS cached_tokens,
    if(s.prompt_tokens_sum > 0, s.cached_tokens_sum / s.prompt_tokens_sum, NULL) AS token_weighted_hit_rate,
    c.hit_tokens AS vllm_hit_tokens,
    c.query_tokens AS vllm_query_tokens,
    if(c.query_tokens > 0, c.hit_tokens / c.query_tokens, NULL) AS vllm_token_weighted_hit_rate,
    u.kv_cache_usage AS kv_cache_usage,
    sc.engines AS engines,
    toUInt32OrNull(cf.config_labels['block_size']) AS block_size,
    cf.config_labels['enable_prefix_caching'] AS enable_prefix_caching,
    cf.config_labels['prefix_caching_hash_algo'] AS prefix_caching_hash_algo,
    toFloat64OrNull(cf.config_labels['kv_cache_memory_bytes'])
        / nullIf(toFloat64OrNull(cf.config_labels['kv_cache_size_tokens']), 0) AS bytes_per_token,
    sc.last_scrape_ts AS last_scrape_ts
FROM pod_names AS p
LEFT JOIN served AS s ON p.pod_name = s.pod_name
LEFT JOIN counted AS c ON p.pod_name = c.pod_name
LEFT JOIN scraped AS sc ON p.pod_name = sc.pod_name
LEFT JOIN usage AS u ON p.pod_name = u.pod_name
LEFT JOIN config AS cf ON p.pod_name = cf.pod_name
ORDER BY pod
