-- name: tenant_pod_matrix
-- description: The tenant × pod matrix of served prefix tokens (which pods hold each tenant's prefixes), with requests and the token-weighted hit rate per cell.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: tenant_id String | tenant
-- returns: pod String | pod that served the requests
-- returns: requests UInt64 | served requests (status < 400, prompt_tokens > 0)
-- returns: prefix_tokens UInt64 | Σ max(prompt_tokens - suffix_tokens, 0): tokens of the stable prefix (everything before the final message, chat-template tokens included), tokens
-- returns: prompt_tokens UInt64 | Σ prompt tokens, tokens
-- returns: cached_tokens UInt64 | Σ cached tokens of the requests whose cached count is known, tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | cached_tokens / prompt tokens of the requests whose cached count is known, fraction 0..1
-- returns: cached_tokens_coverage Nullable(Float64) | prompt tokens of served requests whose cached count the pod reported / prompt_tokens, fraction 0..1 (the share the hit rate covers)
--
-- Reads requests_rollup (sql/migrations/0012, 0014).
SELECT
    CAST(tenant_id AS String) AS tenant_id,
    CAST(pod AS String) AS pod,
    sum(served) AS requests,
    sum(prefix_tokens) AS prefix_tokens,
    sum(prompt_tokens) AS prompt_tokens,
    sum(cached_tokens) AS cached_tokens,
    if(sum(known_prompt_tokens) > 0, cached_tokens / sum(known_prompt_tokens), NULL) AS token_weighted_hit_rate,
    if(prompt_tokens > 0, sum(known_prompt_tokens) / prompt_tokens, NULL) AS cached_tokens_coverage
FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
GROUP BY tenant_id, pod
HAVING requests > 0
ORDER BY tenant_id, pod
