-- name: tenant_affinity
-- description: Per tenant: tenant_cache_affinity (the token-weighted share of requests with a prefix-sharing predecessor that went to the predecessor's pod) beside the token- and request-weighted hit rates.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all (predecessors are looked up on every pod)
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: tenant_id String | tenant
-- returns: requests UInt64 | served requests (status < 400, prompt_tokens > 0)
-- returns: prompt_tokens UInt64 | Σ prompt tokens of served requests, tokens
-- returns: cached_tokens UInt64 | Σ cached tokens (prefix_cache_hit_tokens) of the requests whose cached count is known, tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | cached_tokens / prompt tokens of the requests whose cached count is known, fraction 0..1
-- returns: request_weighted_hit_rate Nullable(Float64) | mean over requests with a known cached count of cached/prompt, fraction 0..1
-- returns: cached_tokens_coverage Nullable(Float64) | prompt tokens of served requests whose cached count the pod reported / prompt_tokens, fraction 0..1 (the share the hit rate covers)
-- returns: requests_with_predecessor UInt64 | served requests that have a predecessor sharing their prefix
-- returns: predecessor_tokens UInt64 | Σ prompt tokens of those requests, tokens
-- returns: same_pod_tokens UInt64 | Σ prompt tokens of those requests served by their predecessor's pod, tokens
-- returns: tenant_cache_affinity Nullable(Float64) | same_pod_tokens / predecessor_tokens, fraction 0..1; NULL when no request has a predecessor
-- returns: pods UInt64 | distinct pods that served the tenant
--
-- A request's predecessor is the one the attribution job named (docs/miss-causes.md); affinity counts those
-- that share the prefix: the previous turn of the conversation or agent run, or the same prompt_fingerprint.
-- Reads requests_rollup and affinity_rollup (sql/migrations/0012, 0014), sign-weighted, exact.
WITH
    traffic AS
    (
        SELECT CAST(tenant_id AS String) AS tenant, sum(served) AS requests, sum(prompt_tokens) AS prompt_sum,
               sum(cached_tokens) AS cached_sum, sum(hit_ratio_sum) AS ratio_sum,
               sum(known_prompt_tokens) AS known_prompt_sum, sum(known_served) AS known_requests,
               uniqExactIf(pod, served > 0) AS pod_count
        FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
        WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
        GROUP BY tenant
        HAVING requests > 0
    ),
    affinity AS
    (
        SELECT CAST(tenant_id AS String) AS tenant, sum(with_predecessor) AS with_pred,
               sum(predecessor_tokens) AS pred_tokens, sum(same_pod_tokens) AS same_tokens
        FROM affinity_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
        WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
        GROUP BY tenant
    )
SELECT
    t.tenant AS tenant_id,
    t.requests AS requests,
    t.prompt_sum AS prompt_tokens,
    t.cached_sum AS cached_tokens,
    if(t.known_prompt_sum > 0, t.cached_sum / t.known_prompt_sum, NULL) AS token_weighted_hit_rate,
    if(t.known_requests > 0, t.ratio_sum / t.known_requests, NULL) AS request_weighted_hit_rate,
    if(t.prompt_sum > 0, t.known_prompt_sum / t.prompt_sum, NULL) AS cached_tokens_coverage,
    toUInt64(greatest(a.with_pred, 0)) AS requests_with_predecessor,
    toUInt64(greatest(a.pred_tokens, 0)) AS predecessor_tokens,
    toUInt64(greatest(a.same_tokens, 0)) AS same_pod_tokens,
    if(predecessor_tokens > 0, same_pod_tokens / predecessor_tokens, NULL) AS tenant_cache_affinity,
    t.pod_count AS pods
FROM traffic AS t
LEFT JOIN affinity AS a ON t.tenant = a.tenant
ORDER BY tenant_id
