-- served_requests: the gateway requests that count in hit rates, tokens, affinity and the tenant × pod matrix,
-- defined once: served (status < 400) with a known prompt (prompt_tokens > 0), deduplicated (FINAL), in the
-- window [since, until) on arrival time, optionally one tenant and one pod ('' = all).
-- A parameterized view (ClickHouse docs: "Parameterized Views"), so the named queries share one definition and
-- still bind typed parameters: FROM served_requests(since = {since:DateTime64(3, 'UTC')}, ...). A view has no
-- engine or ORDER BY: it reads gateway_requests, whose ORDER BY (tenant_id, ts, ...) serves these filters.
CREATE VIEW IF NOT EXISTS served_requests AS
SELECT *
FROM gateway_requests FINAL
WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
  AND ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND ({pod:String} = '' OR pod = {pod:String})
  AND status < 400 AND prompt_tokens > 0;
