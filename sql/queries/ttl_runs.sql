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
-- Reads request_attribution's current answers, the run ids and previous turns' prompt tokens from gateway_requests
-- (the part sql/parts/next_turns.sql, as ttl_survival, ttl_hold_time and turn_gaps), each pod's bytes per token
-- (sql/parts/kv_bytes_per_token.sql, as ttl_hold_time) and the prefill cost per token
-- (sql/parts/prefill_cost.sql, as miss_causes). A previous turn's log line is the latest of its request_id at or
-- before the next turn's ts (request ids can repeat across runs; the attribution keeps the predecessor's id, not
-- its ts): exact unless another request reusing the id arrived between the previous turn and its next turn.
WITH
    -- include: next_turns
    -- include: kv_bytes_per_token
    -- include: prefill_cost
    costed AS
    (
        SELECT t.tenant_name AS tenant_name, t.model_name AS model_name,
               if(own.conversation != '', 'conversation', 'agent_run') AS kind,
               if(own.conversation != '', own.conversation, own.agent_run) AS run,
               t.gap AS gap, t.wait_evicted_tokens AS evicted_tokens,
               t.wait_evicted_tokens * seconds_per_token_on(t.pod_name) * 1000 AS recompute_ms,
               if(prev.request_id = '', NULL, toFloat64(prev.prompt)) * bytes_per_token_on(t.pod_name) AS retained
        FROM next_turns AS t
        ANY LEFT JOIN turn_log AS own ON t.request_id = own.request_id AND t.turn_ts = own.ts
        -- the previous turn's log line: the latest of its request_id at or before this turn (ids can repeat)
        ASOF LEFT JOIN turn_log AS prev ON t.predecessor = prev.request_id AND t.turn_ts >= prev.ts
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
