-- name: miss_examples
-- description: The largest miss of each (tenant, cause, sub_cause) in the window: the request miss_requests lists first for that tenant, cause and sub-cause, for all of them in one read (the evidence "what to fix first" shows beside each finding).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: tenant_id String | tenant ('' for traffic without one)
-- returns: cause String | miss cause
-- returns: sub_cause String | sub-cause ('' if none)
-- returns: ts DateTime64(3, 'UTC') | the example request's arrival at the gateway, UTC
-- returns: request_id String | the example request: the most missed tokens of this cause and sub-cause, then the latest, then the first request_id (miss_requests' order)
-- returns: pod String | pod that served it
-- returns: missed_tokens UInt64 | its missed tokens explained by this cause, tokens
-- returns: predecessor_request_id String | the request whose prefix it should have reused ('' if none)
-- returns: predecessor_pod String | pod that served the predecessor ('' if none)
-- returns: gap_ms Nullable(Float64) | time between the predecessor and the request, ms (NULL if none)
--
-- Current answers only, as miss_requests reads them (a +1 row that no -1 row of the same request
-- (request_id, ts) and version cancels;
-- sql/migrations/0009). One pass over the window's answers grouped by (tenant, cause, sub_cause): a page that
-- shows a finding per tenant makes one read instead of one miss_requests per finding.
WITH
    cancelled AS
    (
        SELECT request_id, ts, version FROM request_attribution
        WHERE sign = -1 AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
    )
SELECT tenant_id, cause, sub_cause, top.1 AS ts, top.2 AS request_id, top.3 AS pod, top.4 AS missed_tokens,
       top.5 AS predecessor_request_id, top.6 AS predecessor_pod, top.7 AS gap_ms
FROM
(
    SELECT CAST(a.tenant_id AS String) AS tenant_id, CAST(c AS String) AS cause, CAST(sc AS String) AS sub_cause,
           argMin((a.ts, a.request_id, CAST(a.pod AS String), toUInt64(n), a.predecessor_request_id,
                  CAST(a.predecessor_pod AS String), a.gap_ms),
                  (-toInt64(n), -toUnixTimestamp64Milli(a.ts), a.request_id)) AS top
    FROM request_attribution AS a
    ARRAY JOIN a.causes AS c, a.sub_causes AS sc, a.missed_tokens AS n
    WHERE a.sign = 1 AND a.ts >= {since:DateTime64(3, 'UTC')} AND a.ts < {until:DateTime64(3, 'UTC')}
      AND ({tenant:String} = '' OR a.tenant_id = {tenant:String})
      AND ({pod:String} = '' OR a.pod = {pod:String}) AND ({model:String} = '' OR a.model = {model:String})
      AND (a.request_id, a.ts, a.version) NOT IN (SELECT request_id, ts, version FROM cancelled)
    GROUP BY tenant_id, cause, sub_cause
)
ORDER BY tenant_id, cause, sub_cause
