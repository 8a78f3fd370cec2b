-- name: tenant_affinity
-- description: Per tenant: tenant_cache_affinity (the token-weighted share of requests with a prefix-sharing predecessor that went to the predecessor's pod) beside the token- and request-weighted hit rates.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all (predecessors are looked up on every pod)
-- returns: tenant_id String | tenant
-- returns: requests UInt64 | served requests (status < 400, prompt_tokens > 0)
-- returns: prompt_tokens UInt64 | Σ prompt tokens of served requests, tokens
-- returns: cached_tokens UInt64 | Σ cached tokens (prefix_cache_hit_tokens), tokens
-- returns: token_weighted_hit_rate Nullable(Float64) | cached_tokens / prompt_tokens, fraction 0..1
-- returns: request_weighted_hit_rate Nullable(Float64) | mean over requests of cached/prompt, fraction 0..1
-- returns: requests_with_predecessor UInt64 | served requests that have a predecessor sharing their prefix
-- returns: predecessor_tokens UInt64 | Σ prompt tokens of those requests, tokens
-- returns: same_pod_tokens UInt64 | Σ prompt tokens of those requests served by their predecessor's pod, tokens
-- returns: tenant_cache_affinity Nullable(Float64) | same_pod_tokens / predecessor_tokens, fraction 0..1; NULL when no request has a predecessor
-- returns: pods UInt64 | distinct pods that served the tenant
--
-- A request's predecessor (DESIGN.md, tenant_cache_affinity): the one miss_attribution names
-- (predecessor_request_id / predecessor_pod) when it names one; else the previous served request of the
-- same agent run, else of the same conversation; else the previous request with the same
-- prompt_fingerprint (any tenant: a shared prefix is shared whoever sent it). Requests up to one day
-- before `since` are read so that a request early in the window still finds its predecessor.
WITH
    served AS
    (
        SELECT
            request_id, ts, CAST(tenant_id AS String) AS tenant, CAST(pod AS String) AS served_pod, prompt_tokens,
            cached_tokens,
            multiIf(agent_run_id != '', concat('run:', agent_run_id),
                    conversation_id != '', concat('conv:', conversation_id), '') AS thread,
            prompt_fingerprint
        FROM served_requests(since = {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY, until = {until:DateTime64(3, 'UTC')},
                             tenant = '', pod = '')
    ),
    threaded AS
    (
        SELECT *,
            if(thread != '' AND row_number() OVER by_thread > 1, lagInFrame(served_pod) OVER by_thread, '')
                AS thread_predecessor_pod,
            if(prompt_fingerprint != '' AND row_number() OVER by_fingerprint > 1,
               lagInFrame(served_pod) OVER by_fingerprint, '') AS fingerprint_predecessor_pod
        FROM served
        WINDOW
            by_thread AS (PARTITION BY tenant, thread ORDER BY ts, request_id
                          ROWS BETWEEN 1 PRECEDING AND CURRENT ROW),
            by_fingerprint AS (PARTITION BY prompt_fingerprint ORDER BY ts, request_id
                               ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
    ),
    attributed AS
    (
        -- the current answer's predecessor (its request_attribution rows sum to sign +1; sql/migrations/0009)
        SELECT request_id, any(CAST(predecessor_pod AS String)) AS attributed_predecessor_pod
        FROM request_attribution
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND predecessor_pod != ''
        GROUP BY request_id, ts, version
        HAVING sum(sign) > 0
    ),
    requests AS
    (
        SELECT
            t.tenant AS tenant, t.served_pod AS served_pod, t.prompt_tokens AS request_prompt_tokens,
            t.cached_tokens AS request_cached_tokens,
            multiIf(a.attributed_predecessor_pod != '', a.attributed_predecessor_pod,
                    t.thread_predecessor_pod != '', t.thread_predecessor_pod,
                    t.fingerprint_predecessor_pod) AS predecessor_pod
        FROM threaded AS t
        LEFT JOIN attributed AS a ON t.request_id = a.request_id
        WHERE t.ts >= {since:DateTime64(3, 'UTC')}
          AND ({tenant:String} = '' OR t.tenant = {tenant:String})
          AND ({pod:String} = '' OR t.served_pod = {pod:String})
    )
SELECT
    tenant AS tenant_id,
    count() AS requests,
    sum(toUInt64(request_prompt_tokens)) AS prompt_tokens,
    sum(toUInt64(request_cached_tokens)) AS cached_tokens,
    if(prompt_tokens > 0, cached_tokens / prompt_tokens, NULL) AS token_weighted_hit_rate,
    CAST(avg(request_cached_tokens / request_prompt_tokens) AS Nullable(Float64)) AS request_weighted_hit_rate,
    countIf(predecessor_pod != '') AS requests_with_predecessor,
    sumIf(toUInt64(request_prompt_tokens), predecessor_pod != '') AS predecessor_tokens,
    sumIf(toUInt64(request_prompt_tokens), predecessor_pod != '' AND predecessor_pod = served_pod)
        AS same_pod_tokens,
    if(predecessor_tokens > 0, same_pod_tokens / predecessor_tokens, NULL) AS tenant_cache_affinity,
    uniqExact(served_pod) AS pods
FROM requests
GROUP BY tenant
ORDER BY tenant
