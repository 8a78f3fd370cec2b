-- name: data_quality
-- description: Per pod: the two sources of the hit rate side by side (vLLM's counters, the gateway log), the gap between them in percentage points and tokens, the coverage of each input, and the likely cause of a disagreement from the evidence (cached counts not reported, hits from a KV connector, requests the gateway did not see, requests vLLM ran as several engine requests, preemption recomputes).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: pod String | pod name (gateway log `pod` = the collector's name for the scrape target)
-- returns: gateway_requests UInt64 | served requests in the gateway log (status < 400, prompt_tokens > 0)
-- returns: gateway_engine_requests UInt64 | the engine requests vLLM ran for the served requests (gateway log `engine_requests`: n × prompts, 1 for most requests); vLLM counts each one as a finished request
-- returns: vllm_requests Nullable(UInt64) | Δ vllm:request_success_total over all finished_reason values (finished engine requests); NULL without vLLM series
-- returns: gateway_prompt_tokens UInt64 | Σ prompt tokens of served requests (gateway), tokens
-- returns: vllm_prompt_tokens Nullable(UInt64) | Δ vllm:prompt_tokens_total, tokens
-- returns: cached_tokens_coverage Nullable(Float64) | prompt tokens of served requests whose cached count the pod reported / all their prompt tokens, fraction 0..1
-- returns: skipped_prompt_tokens UInt64 | prompt tokens of served requests that read no prefix cache (prompt logprobs: skip_reading_prefix_cache): no cached count by design, in neither hit rate (vLLM counts them in no prefix-cache query), so not a missing count, tokens
-- returns: fan_out_prompt_tokens UInt64 | prompt tokens of served requests vLLM ran as several engine requests (n > 1, or a completions list of prompts): no cached count by design (one sequence's count is not the prompt's), in the gateway's hit rate neither; vLLM looks each engine request's prompt up on its own, tokens
-- returns: request_coverage Nullable(Float64) | gateway_engine_requests / vllm_requests, fraction (above 1 when vLLM counted fewer); NULL when vLLM finished none
-- returns: gateway_hit_tokens UInt64 | Σ cached tokens of served requests with a known count, tokens
-- returns: gateway_hit_rate Nullable(Float64) | gateway_hit_tokens / their prompt tokens (known counts only), fraction 0..1
-- returns: vllm_hit_tokens Nullable(UInt64) | Δ vllm:prefix_cache_hits_total (older: vllm:gpu_prefix_cache_hits_total), tokens
-- returns: vllm_query_tokens Nullable(UInt64) | Δ vllm:prefix_cache_queries_total (older: vllm:gpu_prefix_cache_queries_total), tokens
-- returns: vllm_hit_rate Nullable(Float64) | vllm_hit_tokens / vllm_query_tokens, fraction 0..1
-- returns: gap_pp Nullable(Float64) | (gateway_hit_rate - vllm_hit_rate) x 100, percentage points
-- returns: gap_tokens Nullable(Int64) | gateway_hit_tokens - vllm_hit_tokens, tokens (positive: the gateway counted more hits)
-- returns: external_hit_tokens Nullable(UInt64) | Δ vllm:external_prefix_cache_hits_total: hits served by a KV connector, tokens
-- returns: preemptions Nullable(UInt64) | Δ vllm:num_preemptions_total
-- returns: likely_cause String | agree, no_vllm_metrics, no_gateway_traffic, external_kv_connector, requests_not_seen_by_gateway, several_engine_requests, window_edge, details_not_reported, no_cache_queries, preemption_recompute, unexplained (the first rule that holds; docs/miss-causes.md "When the two sources disagree")
-- returns: evidence String | the figures behind likely_cause, in words
--
-- Reads requests_rollup and vllm_rollup (sql/migrations/0012, 0014, 0041, 0044). The sources agree when |gap_pp| < 0.5.
WITH
    per_pod AS
    (
        SELECT pod_name,
               sum(g_served) AS g_served, sum(g_prompt) AS g_prompt, sum(g_known) AS g_known, sum(g_hit) AS g_hit,
               sum(g_skipped) AS g_skipped, sum(g_engine) AS g_engine, sum(g_fan_out) AS g_fan_out,
               max(has_vllm) AS has_vllm, sum(v_requests) AS v_requests, sum(v_prompt) AS v_prompt,
               sum(v_hits) AS v_hits, sum(v_queries) AS v_queries, sum(v_external) AS v_external,
               sum(v_preemptions) AS v_preemptions
        FROM
        (
            SELECT CAST(pod AS String) AS pod_name, sum(served) AS g_served, sum(prompt_tokens) AS g_prompt,
                   sum(known_prompt_tokens) AS g_known, sum(cached_tokens) AS g_hit,
                   sum(skipped_prompt_tokens) AS g_skipped, sum(engine_requests) AS g_engine,
                   sum(fan_out_prompt_tokens) AS g_fan_out, toUInt8(0) AS has_vllm,
                   0. AS v_requests, 0. AS v_prompt, 0. AS v_hits, 0. AS v_queries, 0. AS v_external,
                   0. AS v_preemptions
            FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
            WHERE ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
            GROUP BY pod_name
            UNION ALL
            SELECT CAST(pod AS String) AS pod_name, 0, 0, 0, 0, 0, 0, 0, toUInt8(1),
                   sumIf(increase, name = 'vllm:request_success_total'),
                   sumIf(increase, name = 'vllm:prompt_tokens_total'),
                   sumIf(increase, name IN ('vllm:prefix_cache_hits_total', 'vllm:gpu_prefix_cache_hits_total')),
                   sumIf(increase, name IN ('vllm:prefix_cache_queries_total', 'vllm:gpu_prefix_cache_queries_total')),
                   sumIf(increase, name = 'vllm:external_prefix_cache_hits_total'),
                   sumIf(increase, name = 'vllm:num_preemptions_total')
            FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1,
                             names = ['vllm:request_success_total', 'vllm:prompt_tokens_total',
                                      'vllm:prefix_cache_hits_total', 'vllm:gpu_prefix_cache_hits_total',
                                      'vllm:prefix_cache_queries_total', 'vllm:gpu_prefix_cache_queries_total',
                                      'vllm:external_prefix_cache_hits_total', 'vllm:num_preemptions_total'])
            WHERE ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model_name = {model:String})
            GROUP BY pod_name
        )
        GROUP BY pod_name
    ),
    figures AS
    (
        SELECT
            pod_name AS pod,
            toUInt64(g_served) AS gateway_requests,
            toUInt64(g_engine) AS gateway_engine_requests,
            CAST(if(has_vllm = 1, toUInt64(round(v_requests)), NULL) AS Nullable(UInt64)) AS vllm_requests,
            toUInt64(g_prompt) AS gateway_prompt_tokens,
            CAST(if(has_vllm = 1, toUInt64(round(v_prompt)), NULL) AS Nullable(UInt64)) AS vllm_prompt_tokens,
            CAST(if(g_prompt > 0, g_known / g_prompt, NULL) AS Nullable(Float64)) AS cached_tokens_coverage,
            toUInt64(g_skipped) AS skipped_prompt_tokens,
            toUInt64(g_fan_out) AS fan_out_prompt_tokens,
            CAST(if(vllm_requests > 0, gateway_engine_requests / vllm_requests, NULL) AS Nullable(Float64))
                AS request_coverage,
            toUInt64(g_hit) AS gateway_hit_tokens,
            CAST(if(g_known > 0, g_hit / g_known, NULL) AS Nullable(Float64)) AS gateway_hit_rate,
            CAST(if(has_vllm = 1, toUInt64(round(v_hits)), NULL) AS Nullable(UInt64)) AS vllm_hit_tokens,
            CAST(if(has_vllm = 1, toUInt64(round(v_queries)), NULL) AS Nullable(UInt64)) AS vllm_query_tokens,
            CAST(if(vllm_query_tokens > 0, vllm_hit_tokens / vllm_query_tokens, NULL) AS Nullable(Float64))
                AS vllm_hit_rate,
            CAST((gateway_hit_rate - vllm_hit_rate) * 100 AS Nullable(Float64)) AS gap_pp,
            CAST(toInt64(gateway_hit_tokens) - toInt64(vllm_hit_tokens) AS Nullable(Int64)) AS gap_tokens,
            CAST(if(has_vllm = 1, toUInt64(round(v_external)), NULL) AS Nullable(UInt64)) AS external_hit_tokens,
            CAST(if(has_vllm = 1, toUInt64(round(v_preemptions)), NULL) AS Nullable(UInt64)) AS preemptions
        FROM per_pod
    )
SELECT
    *,
    multiIf(
        vllm_requests IS NULL, 'no_vllm_metrics',
        gateway_requests = 0, 'no_gateway_traffic',
        gap_pp IS NOT NULL AND abs(gap_pp) < 0.5, 'agree',
        external_hit_tokens > 0, 'external_kv_connector',
        vllm_requests > gateway_engine_requests, 'requests_not_seen_by_gateway',
        cached_tokens_coverage + (skipped_prompt_tokens + fan_out_prompt_tokens) / gateway_prompt_tokens < 0.99,
            'details_not_reported',
        fan_out_prompt_tokens > 0, 'several_engine_requests',
        gap_pp IS NULL, 'no_cache_queries',
        gateway_engine_requests > vllm_requests, 'window_edge',
        preemptions > 0 AND gap_tokens < 0, 'preemption_recompute',
        'unexplained') AS likely_cause,
    ifNull(multiIf(
        likely_cause = 'no_vllm_metrics', 'no vLLM series for this pod in the window: is it scraped under this name?',
        likely_cause = 'no_gateway_traffic', concat('vLLM finished ', toString(vllm_requests),
            ' requests and the gateway logged none: traffic reaches this pod without the gateway'),
        likely_cause = 'agree', concat('the two hit rates differ by ', toString(round(gap_pp, 2)), ' pp'),
        likely_cause = 'external_kv_connector', concat(toString(external_hit_tokens),
            ' tokens were hits in a KV connector''s cache: the gateway''s cached count includes them, vLLM''s local prefix-cache counters do not'),
        likely_cause = 'requests_not_seen_by_gateway', concat('vLLM finished ', toString(vllm_requests),
            ' requests, the gateway logged ', toString(gateway_requests),
            if(gateway_engine_requests > gateway_requests, concat(', run as ', toString(gateway_engine_requests),
               ' engine requests'), ''),
            ' (', toString(vllm_prompt_tokens),
            ' vs ', toString(gateway_prompt_tokens), ' prompt tokens): the rest bypassed the gateway'),
        likely_cause = 'several_engine_requests', concat(toString(fan_out_prompt_tokens),
            ' prompt tokens were of requests vLLM ran as several engine requests (n > 1, or a list of prompts: ',
            toString(gateway_engine_requests), ' engine requests for ', toString(gateway_requests),
            ' requests logged). vLLM looks each one up in the prefix cache on its own, so its hit rate counts the hits of parallel samples on each other''s blocks; the gateway has no hit count for them and leaves them out'),
        likely_cause = 'window_edge', concat('the gateway logged ', toString(gateway_engine_requests),
            ' engine requests, vLLM''s counters show ', toString(vllm_requests),
            ' finished: requests near the window''s edges (in flight, or after the last scrape) count on one side only; widen the window or wait for the next scrape'),
        likely_cause = 'details_not_reported', concat('the pod reported cached counts for ',
            toString(round(cached_tokens_coverage * 100, 1)),
            ' % of the prompt tokens: the gateway''s hit rate covers only those requests (a stream the client cut has no count, and vLLM does not count it as finished)'),
        likely_cause = 'no_cache_queries', concat('no hit rate to compare on one side or both: vLLM counted ',
            toString(ifNull(vllm_query_tokens, 0)), ' prefix-cache query tokens; the gateway has a cached count for ',
            toString(round(ifNull(cached_tokens_coverage, 0) * 100, 1)), ' % of its prompt tokens, and ',
            toString(skipped_prompt_tokens), ' of them read no prefix cache (prompt logprobs: no lookup on either side)'),
        likely_cause = 'preemption_recompute', concat(toString(preemptions),
            ' preemptions: a preempted request is prefilled again and its recomputed prefix counts as vLLM hits a second time'),
        concat('a gap of ', toString(round(gap_pp, 2)), ' pp (', toString(gap_tokens),
               ' tokens) with every input complete and no connector or preemption: compare the pod''s vLLM version and flags')
    ), '') AS evidence
FROM figures
ORDER BY pod
