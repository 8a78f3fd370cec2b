-- name: miss_requests
-- description: Drill-down from a miss cause to requests: one row per (request, cause, sub_cause) with its missed tokens and what re-computing them cost, the request's token counts, its predecessor and pods, largest misses first.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: cause: String = '' | miss cause to keep, '' = all
-- param: sub_cause: String = '' | sub-cause to keep, '' = all
-- param: limit: UInt32 = 100 | at most this many rows
-- returns: ts DateTime64(3, 'UTC') | request arrival at the gateway, UTC
-- returns: request_id String | gateway request id (vLLM response id is chatcmpl-<request_id>)
-- returns: tenant_id String | tenant
-- returns: pod String | pod that served the request
-- returns: cause String | miss cause
-- returns: sub_cause String | sub-cause ('' if none)
-- returns: missed_tokens UInt64 | missed tokens of this request explained by this cause, tokens (not_reported: its prompt tokens whose hits are unknown, not missed)
-- returns: gpu_seconds Nullable(Float64) | what re-computing those missed tokens cost: missed_tokens × the serving pod's measured prefill seconds per computed token in the window (else the fleet's), GPU-seconds, as miss_causes; NULL when no pod measured prefill time (vllm:request_prefill_time_seconds) in the window, and for not_reported (its tokens' hits are unknown: no miss known, no cost)
-- returns: request_missed_tokens UInt64 | all missed tokens of this request (prompt - cached; the whole prompt when cached was not reported), tokens
-- returns: prompt_tokens UInt64 | the request's prompt tokens (gateway log; 0 if the log row is missing)
-- returns: cached_tokens Nullable(UInt64) | the request's cached tokens (gateway log; NULL when the pod did not report it or the log row is missing)
-- returns: predecessor_request_id String | the request whose prefix this one should have reused ('' if none)
-- returns: predecessor_pod String | pod that served the predecessor ('' if none)
-- returns: gap_ms Nullable(Float64) | time between the predecessor and this request, ms (NULL if none)
-- returns: conversation_id String | conversation ('' if none or the log row is missing)
-- returns: agent_run_id String | agent run ('' if none or the log row is missing)
-- returns: routing_reason String | why the gateway chose this pod ('' if the log row is missing)
--
-- The current answer of a request is its request_attribution row with sign +1 that no row with sign -1 of the
-- same request (request_id, ts: ids can repeat across runs) and version cancels (a replaced answer is cancelled
-- that way; sql/migrations/0009). The cancelled set is small, so the anti-join is cheap; the top rows then come
-- from a partial sort, no GROUP BY over the window. The log row is the one of the same (request_id, ts).
-- GPU-seconds: the part sql/parts/prefill_cost.sql, as miss_causes.
WITH
    -- include: prefill_cost
    cancelled AS
    (
        SELECT request_id, ts, version FROM request_attribution
        WHERE sign = -1 AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
    ),
    misses AS
    (
        SELECT
            a.ts AS ts, a.request_id AS request_id, CAST(a.tenant_id AS String) AS tenant_id,
            CAST(a.pod AS String) AS pod, CAST(c AS String) AS cause, CAST(sc AS String) AS sub_cause,
            toUInt64(n) AS missed_tokens, toUInt64(arraySum(a.missed_tokens)) AS request_missed_tokens,
            a.predecessor_request_id AS predecessor_request_id,
            CAST(a.predecessor_pod AS String) AS predecessor_pod, a.gap_ms AS gap_ms
        FROM request_attribution AS a
        ARRAY JOIN a.causes AS c, a.sub_causes AS sc, a.missed_tokens AS n
        WHERE a.sign = 1 AND a.ts >= {since:DateTime64(3, 'UTC')} AND a.ts < {until:DateTime64(3, 'UTC')}
          AND ({tenant:String} = '' OR a.tenant_id = {tenant:String})
          AND ({pod:String} = '' OR a.pod = {pod:String}) AND ({model:String} = '' OR a.model = {model:String})
          AND ({cause:String} = '' OR c = {cause:String})
          AND ({sub_cause:String} = '' OR sc = {sub_cause:String})
          AND (a.request_id, a.ts, a.version) NOT IN (SELECT request_id, ts, version FROM cancelled)
        ORDER BY missed_tokens DESC, ts DESC, request_id, cause, sub_cause
        LIMIT {limit:UInt32}
    ),
    requests AS
    (
        SELECT request_id, ts, any(prompt_tokens) AS prompt_tokens, any(cached_tokens) AS cached_tokens,
               any(conversation_id) AS conversation_id, any(agent_run_id) AS agent_run_id,
               any(CAST(routing_reason AS String)) AS routing_reason
        FROM gateway_requests
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND (request_id, ts) IN (SELECT request_id, ts FROM misses)
        GROUP BY request_id, ts
    )
SELECT
    m.ts AS ts, m.request_id AS request_id, m.tenant_id AS tenant_id, m.pod AS pod, m.cause AS cause,
    m.sub_cause AS sub_cause, m.missed_tokens AS missed_tokens,
    if(m.cause = 'not_reported', NULL, m.missed_tokens * seconds_per_token_on(m.pod)) AS gpu_seconds, m.request_missed_tokens AS request_missed_tokens,
    toUInt64(r.prompt_tokens) AS prompt_tokens, CAST(r.cached_tokens AS Nullable(UInt64)) AS cached_tokens,
    m.predecessor_request_id AS predecessor_request_id, m.predecessor_pod AS predecessor_pod,
    m.gap_ms AS gap_ms, r.conversation_id AS conversation_id, r.agent_run_id AS agent_run_id,
    r.routing_reason AS routing_reason
FROM misses AS m
LEFT JOIN requests AS r ON m.request_id = r.request_id AND m.ts = r.ts
ORDER BY missed_tokens DESC, ts DESC, request_id, cause, sub_cause
