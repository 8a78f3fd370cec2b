-- name: miss_causes
-- description: Missed prompt tokens (prefix_cache_miss_tokens) by miss cause and sub-cause, with each one's share of all missed tokens and the requests it affected; optionally split per tenant.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: by_tenant: UInt8 = 0 | 1 = one row per (tenant, cause, sub_cause); 0 = tenants pooled (tenant_id '')
-- returns: tenant_id String | tenant, or '' when by_tenant = 0
-- returns: cause String | miss cause (docs/miss-causes.md): unavoidable, below_block, cold, beyond_horizon (the prefix was last seen longer ago than the attribution horizon), routed_away, evicted, prefix_drift, unknown, not_reported (the pod did not report the request's cached count: all its prompt tokens)
-- returns: sub_cause String | prefix_drift: the first segment that changed (volatile_system, system_changed, tools_reordered, tools_changed, rag_reordered, rag_changed, history_truncated, history_changed, cache_salt_changed); evicted: evicted_before_next_turn, or cache_reset (precise mode: the blocks left by an AllBlocksCleared or a vLLM restart); unknown: resident_at_arrival (precise mode: resident on the pod at arrival, missed all the same); routed_away: pod_down (the pod holding the prefix was down when the request was routed); not_reported: skip_reading_prefix_cache (vLLM read no prefix cache: prompt logprobs), several_engine_requests (vLLM ran it as several engine requests: n > 1 or a list of prompts); else ''
-- returns: missed_tokens UInt64 | missed prompt tokens explained by this cause, tokens (each missed token counted once); for not_reported the prompt tokens whose hits are unknown (all those requests' prompt tokens): not missed tokens, shown apart as unknown
-- returns: share_of_missed Float64 | missed_tokens / all missed tokens of requests whose hits are known in the window and filters (the result's rows other than not_reported), fraction 0..1; 0 for not_reported
-- returns: requests UInt64 | distinct requests with missed tokens of this cause
-- returns: gpu_seconds Nullable(Float64) | what re-computing these missed tokens cost: Σ over pods of missed tokens × the pod's measured prefill seconds per computed token in the window (else the fleet's), GPU-seconds; NULL when no pod measured prefill time (vllm:request_prefill_time_seconds) in the window, and for not_reported (no miss known: no cost)
--
-- Reads misses_rollup (sql/migrations/0012): missed tokens and requests per cause, weighted by the sign of each
-- answer (a replaced answer cancels itself), so exact without FINAL. GPU-seconds: each pod's missed tokens times
-- that pod's measured prefill seconds per computed prompt token over the same window, else the fleet's (the part
-- sql/parts/prefill_cost.sql, shared by every query that shows a cost). not_reported carries all the prompt
-- tokens of the requests whose cached count is unknown (docs/miss-causes.md, "When the cached count is not
-- reported"): they are no missed tokens, so shares are over the other rows and the row has no cost; readers that
-- total missed tokens leave it out (as hit_rate_total's query_tokens - hit_tokens does). Rows: largest first,
-- not_reported last.
WITH
    -- include: prefill_cost
    per_pod AS
    (
        SELECT
            if({by_tenant:UInt8} = 1, CAST(tenant_id AS String), '') AS tenant,
            CAST(cause AS String) AS cause_name,
            CAST(sub_cause AS String) AS sub_cause_name,
            CAST(pod AS String) AS pod_name,
            toUInt64(greatest(sum(missed_tokens), 0)) AS pod_missed,
            toUInt64(greatest(sum(requests), 0)) AS pod_requests
        FROM misses_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
        WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String})
          AND ({model:String} = '' OR model = {model:String})
        GROUP BY tenant, cause_name, sub_cause_name, pod_name
        HAVING pod_missed > 0
    )
SELECT tenant AS tenant_id, cause_name AS cause, sub_cause_name AS sub_cause, missed AS missed_tokens,
       if(cause_name = 'not_reported' OR known_missed = 0, 0., missed / known_missed) AS share_of_missed,
       affected AS requests, gpu_seconds
FROM
(
    SELECT tenant, cause_name, sub_cause_name, sum(pod_missed) AS missed, sum(pod_requests) AS affected,
           if(cause_name = 'not_reported', NULL, sum(pod_missed * seconds_per_token_on(pod_name))) AS gpu_seconds,
           sum(if(cause_name = 'not_reported', 0, sum(pod_missed))) OVER () AS known_missed
    FROM per_pod
    GROUP BY tenant, cause_name, sub_cause_name
)
ORDER BY cause = 'not_reported', missed_tokens DESC, tenant_id, cause, sub_cause
