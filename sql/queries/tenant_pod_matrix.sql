-- name: tenant_pod_matrix
-- description: The tenant × pod matrix of served prefix tokens (which pods hold each tenant's prefixes), with requests and the token-weighted hit rate per cell.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod to keep, '' = all
-- returns: tenant_id String | tenant
-- returns: pod String | pod that served the requests
-- returns: requests UInt64 | served requests (status < 400, prompt_tokens > 0)
-- returns: prefix_tokens UInt64 | Σ max(prompt_tokens - suffix_tokens, 0): tokens of the stable prefix (everything before the final message, chat-template tokens included), tokens
-- returns: prompt_tokens UInt64 | Σ prompt tokens, tokens
-- returns: cached_tokens UInt64 | Σ cached tokens, tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | cached_tokens / prompt_tokens, fraction 0..1
SELECT
    tenant AS tenant_id,
    served_pod AS pod,
    count() AS requests,
    sum(toUInt64(greatest(toInt64(request_prompt_tokens) - toInt64(suffix_tokens), 0))) AS prefix_tokens,
    sum(toUInt64(request_prompt_tokens)) AS prompt_tokens,
    sum(toUInt64(request_cached_tokens)) AS cached_tokens,
    if(prompt_tokens > 0, cached_tokens / prompt_tokens, NULL) AS token_weighted_hit_rate
FROM
(
    SELECT CAST(tenant_id AS String) AS tenant, CAST(pod AS String) AS served_pod, prompt_tokens AS request_prompt_tokens,
           cached_tokens AS request_cached_tokens, suffix_tokens
    FROM served_requests(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                         tenant = {tenant:String}, pod = {pod:String})
)
GROUP BY tenant, served_pod
ORDER BY tenant, served_pod
