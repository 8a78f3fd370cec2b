-- name: ttl_runs
-- description: Per agent run and conversation: how long it waited between turns (tool calls, the user's replies), how many of its prompt tokens the pod evicted during those waits, what re-computing them cost in prefill time, and how many KV-cache bytes holding its prefix through the waits would have taken; the runs that lost most first.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on each next turn's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the next turn, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: kv_bytes_per_token: Float64 = 0 | KV-cache bytes per token for pods whose vllm:cache_config_info does not give it (KVSCOPE_KV_BYTES_PER_TOKEN); 0 = unknown
-- param: limit: UInt32 = 100 | at most this many runs
-- returns: tenant_id String | tenant
-- returns: model String | model (the gateway log's `model`)
-- returns: run_kind String | 'conversation' (the turns share the gateway log's conversation_id) or 'agent_run' (agent_run_id, no conversation_id)
-- returns: run_id String | the conversation_id or agent_run_id, as the gateway logged it
-- returns: next_turns UInt64 | the run's requests in the window whose predecessor is the run's previous turn (predecessor_kind previous_turn), on any pod
-- returns: tool_latency_ms Float64 | Σ of the waits before those turns (previous turn's end to this turn's arrival: the tool calls or the user's replies), ms
-- returns: tool_latency_max_ms Float64 | the longest of those waits, ms
-- returns: evicted_before_next_turn UInt64 | missed tokens of cause evicted / evicted_before_next_turn in those turns: prefix the pod lost during the wait, tokens
-- returns: recompute_prefill_ms Nullable(Float64) | what re-computing those evicted tokens cost: tokens × the serving pod's measured prefill seconds per computed token in the window (else the fleet's), × 1000, GPU-ms; NULL when no pod measured prefill time in the window
-- returns: cache_retained_bytes Nullable(Float64) | KV-cache bytes that hold the run's prefix through its waits: its largest previous-turn prompt × the pod's bytes per token (vllm:cache_config_info kv_cache_memory_bytes / kv_cache_size_tokens, else kv_bytes_per_token), bytes; NULL when bytes per token or the previous turns are unknown
--
-- Reads request_attribution's current answers (sign +1 rows no sign -1 row of the same version cancels,
-- sql/migrations/0009), the run ids and previous turns' prompt tokens from gateway_requests (a previous turn is
-- looked up from a day before the earliest wait on, as in ttl_hold_time), each pod's latest vllm_cache_config
-- before `until`, and the view prefill_rate (sql/migrations/0021) for the prefill cost, as miss_causes.
WITH
    cancelled AS
    (
        SELECT request_id, version FROM request_attribution
        WHERE sign = -1 AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
    ),
    turns AS
    (
        SELECT a.request_id AS request_id, a.ts AS turn_ts, CAST(a.tenant_id AS String) AS tenant_name,
               CAST(a.model AS String) AS model_name, CAST(a.pod AS String) AS pod_name,
               a.predecessor_request_id AS predecessor, assumeNotNull(a.gap_ms) AS gap,
               arraySum((c, s, n) -> if(c = 'evicted' AND s = 'evicted_before_next_turn', toUInt64(n), 0),
                        a.causes, a.sub_causes, a.missed_tokens) AS evicted_tokens
        FROM request_attribution AS a
        WHERE a.sign = 1 AND a.ts >= {since:DateTime64(3, 'UTC')} AND a.ts < {until:DateTime64(3, 'UTC')}
          AND a.predecessor_kind = 'previous_turn' AND a.gap_ms IS NOT NULL
          AND ({tenant:String} = '' OR a.tenant_id = {tenant:String})
          AND ({pod:String} = '' OR a.pod = {pod:String}) AND ({model:String} = '' OR a.model = {model:String})
          AND (a.request_id, a.version) NOT IN (SELECT request_id, version FROM cancelled)
    ),
    (SELECT min(turn_ts - toIntervalMillisecond(toInt64(ceil(gap)))) - INTERVAL 1 DAY FROM turns) AS first_predecessor_ts,
    logged AS
    (
        SELECT request_id, any(prompt_tokens) AS prompt, any(conversation_id) AS conversation,
               any(agent_run_id) AS agent_run
        FROM gateway_requests
        WHERE ts >= first_predecessor_ts AND ts < {until:DateTime64(3, 'UTC')}
          AND (request_id IN (SELECT predecessor FROM turns) OR request_id IN (SELECT request_id FROM turns))
        GROUP BY request_id
    ),
    config AS
    (
        SELECT CAST(pod AS String) AS pod_name, argMax(bytes_per_token, ts) AS pod_bytes_per_token
        FROM vllm_cache_config
        WHERE ts < {until:DateTime64(3, 'UTC')}
        GROUP BY pod_name
    ),
    rate AS
    (
        SELECT pod_name, seconds_per_token
        FROM prefill_rate(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                          model = {model:String})
    ),
    (SELECT if(count() > 0, sum(prefill_seconds) / sum(computed_tokens), NULL)
     FROM prefill_rate(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                       model = {model:String})) AS fleet_seconds_per_token,
    costed AS
    (
        SELECT t.tenant_name AS tenant_name, t.model_name AS model_name,
               if(own.conversation != '', 'conversation', 'agent_run') AS kind,
               if(own.conversation != '', own.conversation, own.agent_run) AS run,
               t.gap AS gap, t.evicted_tokens AS evicted_tokens,
               t.evicted_tokens * if(r.pod_name = '', CAST(fleet_seconds_per_token AS Nullable(Float64)),
                                     r.seconds_per_token) * 1000 AS recompute_ms,
               if(prev.request_id = '', NULL, toFloat64(prev.prompt))
                 * multiIf(c.pod_bytes_per_token > 0, c.pod_bytes_per_token,
                           {kv_bytes_per_token:Float64} > 0, {kv_bytes_per_token:Float64}, NULL) AS retained
        FROM turns AS t
        LEFT JOIN logged AS own ON t.request_id = own.request_id
        LEFT JOIN logged AS prev ON t.predecessor = prev.request_id
        LEFT JOIN config AS c ON t.pod_name = c.pod_name
        LEFT JOIN rate AS r ON t.pod_name = r.pod_name
    )
SELECT
    tenant_name AS tenant_id,
    model_name AS model,
    kind AS run_kind,
    run AS run_id,
    count() AS next_turns,
    sum(gap) AS tool_latency_ms,
    max(gap) AS tool_latency_max_ms,
    sum(evicted_tokens) AS evicted_before_next_turn,
    CAST(sum(recompute_ms) AS Nullable(Float64)) AS recompute_prefill_ms,
    CAST(max(retained) AS Nullable(Float64)) AS cache_retained_bytes
FROM costed
GROUP BY tenant_name, model_name, kind, run
ORDER BY evicted_before_next_turn DESC, tool_latency_ms DESC, tenant_id, run_kind, run_id
LIMIT {limit:UInt32}
