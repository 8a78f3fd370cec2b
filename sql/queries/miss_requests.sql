-- name: miss_requests
-- description: Drill-down from a miss cause to requests: one row per (request, cause, sub_cause) with its missed tokens, the request's token counts, its predecessor and pods, largest misses first.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: cause: String = '' | miss cause to keep, '' = all
-- param: sub_cause: String = '' | sub-cause to keep, '' = all
-- param: limit: UInt32 = 100 | at most this many rows
-- returns: ts DateTime64(3, 'UTC') | request arrival at the gateway, UTC
-- returns: request_id String | gateway request id (vLLM response id is chatcmpl-<request_id>)
-- returns: tenant_id String | tenant
-- returns: pod String | pod that served the request
-- returns: cause String | miss cause
-- returns: sub_cause String | sub-cause ('' if none)
-- returns: missed_tokens UInt64 | missed tokens of this request explained by this cause, tokens
-- returns: request_missed_tokens UInt64 | all missed tokens of this request (prompt - cached), tokens
-- returns: prompt_tokens UInt64 | the request's prompt tokens (gateway log; 0 if the log row is missing)
-- returns: cached_tokens UInt64 | the request's cached tokens (gateway log; 0 if the log row is missing)
-- returns: predecessor_request_id String | the request whose prefix this one should have reused ('' if none)
-- returns: predecessor_pod String | pod that served the predecessor ('' if none)
-- returns: gap_ms Nullable(Float64) | time between the predecessor and this request, ms (NULL if none)
-- returns: conversation_id String | conversation ('' if none or the log row is missing)
-- returns: agent_run_id String | agent run ('' if none or the log row is missing)
-- returns: routing_reason String | why the gateway chose this pod ('' if the log row is missing)
--
-- The current answer of each request is the version of its request_attribution rows whose signs sum to +1
-- (a replaced answer is cancelled by a -1 copy; sql/migrations/0009).
WITH
    answers AS
    (
        SELECT request_id, ts, any(tenant_id) AS tenant_id, any(pod) AS pod, any(causes) AS answer_causes,
               any(sub_causes) AS answer_sub_causes, any(missed_tokens) AS answer_tokens,
               any(predecessor_request_id) AS predecessor_request_id, any(predecessor_pod) AS predecessor_pod,
               any(gap_ms) AS gap_ms
        FROM request_attribution
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({tenant:String} = '' OR request_attribution.tenant_id = {tenant:String})
          AND ({pod:String} = '' OR request_attribution.pod = {pod:String})
          AND notEmpty(causes)
        GROUP BY request_id, ts, version
        HAVING sum(sign) > 0
    ),
    misses AS
    (
        SELECT
            ts, request_id, CAST(tenant_id AS String) AS tenant_id, CAST(pod AS String) AS pod, CAST(cause AS String) AS cause,
            CAST(sub_cause AS String) AS sub_cause, toUInt64(tokens) AS missed_tokens,
            toUInt64(arraySum(answer_tokens)) AS request_missed_tokens,
            predecessor_request_id, CAST(predecessor_pod AS String) AS predecessor_pod, gap_ms
        FROM answers
        ARRAY JOIN answer_causes AS cause, answer_sub_causes AS sub_cause, answer_tokens AS tokens
    ),
    requests AS
    (
        SELECT request_id, any(prompt_tokens) AS prompt_tokens, any(cached_tokens) AS cached_tokens,
               any(conversation_id) AS conversation_id, any(agent_run_id) AS agent_run_id,
               any(CAST(routing_reason AS String)) AS routing_reason
        FROM gateway_requests
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND request_id IN (SELECT request_id FROM misses)
        GROUP BY request_id
    )
SELECT
    m.ts AS ts, m.request_id AS request_id, m.tenant_id AS tenant_id, m.pod AS pod, m.cause AS cause,
    m.sub_cause AS sub_cause, m.missed_tokens AS missed_tokens, m.request_missed_tokens AS request_missed_tokens,
    toUInt64(r.prompt_tokens) AS prompt_tokens, toUInt64(r.cached_tokens) AS cached_tokens,
    m.predecessor_request_id AS predecessor_request_id, m.predecessor_pod AS predecessor_pod,
    m.gap_ms AS gap_ms, r.conversation_id AS conversation_id, r.agent_run_id AS agent_run_id,
    r.routing_reason AS routing_reason
FROM misses AS m
LEFT JOIN requests AS r ON m.request_id = r.request_id
WHERE ({cause:String} = '' OR m.cause = {cause:String})
  AND ({sub_cause:String} = '' OR m.sub_cause = {sub_cause:String})
ORDER BY missed_tokens DESC, ts DESC, request_id, cause, sub_cause
LIMIT {limit:UInt32}
