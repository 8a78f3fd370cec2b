-- name: miss_causes
-- description: Missed prompt tokens (prefix_cache_miss_tokens) by miss cause and sub-cause, with each one's share of all missed tokens and the requests it affected; optionally split per tenant.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: by_tenant: UInt8 = 0 | 1 = one row per (tenant, cause, sub_cause); 0 = tenants pooled (tenant_id '')
-- returns: tenant_id String | tenant, or '' when by_tenant = 0
-- returns: cause String | miss cause (DESIGN.md): unavoidable, below_block, cold, routed_away, evicted, prefix_drift, unknown
-- returns: sub_cause String | prefix_drift: the first segment that changed (volatile_system, system_changed, tools_reordered, tools_changed, rag_reordered, rag_changed, history_truncated); else as the attribution wrote it, often ''
-- returns: missed_tokens UInt64 | missed prompt tokens explained by this cause, tokens (each missed token counted once)
-- returns: share_of_missed Float64 | missed_tokens / all missed tokens in the window and filters (all rows of the result), fraction 0..1
-- returns: requests UInt64 | distinct requests with missed tokens of this cause
--
-- request_attribution keeps every answer ever written, a replaced one cancelled by a copy with sign -1
-- (sql/migrations/0009): weighting by sign counts each request's current answer once, without FINAL.
SELECT
    if({by_tenant:UInt8} = 1, CAST(tenant_id AS String), '') AS tenant_id,
    CAST(cause AS String) AS cause,
    CAST(sub_cause AS String) AS sub_cause,
    toUInt64(sum(toInt64(tokens) * sign)) AS missed_tokens,
    missed_tokens / sum(missed_tokens) OVER () AS share_of_missed,
    toUInt64(sum(sign)) AS requests
FROM request_attribution
ARRAY JOIN causes AS cause, sub_causes AS sub_cause, request_attribution.missed_tokens AS tokens
WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
  AND ({tenant:String} = '' OR request_attribution.tenant_id = {tenant:String})
  AND ({pod:String} = '' OR pod = {pod:String})
GROUP BY tenant_id, cause, sub_cause
HAVING missed_tokens > 0
ORDER BY missed_tokens DESC, tenant_id, cause, sub_cause
