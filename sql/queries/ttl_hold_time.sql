-- name: ttl_hold_time
-- description: For each X in a list of percents (default 50, 90, 99), the hold time that would have kept X % of next turns of conversations and agent runs warm, and what holding that long costs: the tokens, bytes and KV blocks a waiting run holds, and the block-seconds those blocks are taken from other traffic.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the next turn's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served both turns, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: percents: Array(UInt8) = [50, 90, 99] | the shares of next turns to keep warm, whole percents 1..100
-- param: kv_bytes_per_token: Float64 = 0 | KV-cache bytes per token for pods whose vllm:cache_config_info does not give it (KVSCOPE_KV_BYTES_PER_TOKEN); 0 = unknown
-- returns: percent UInt8 | X: the share of next turns to keep warm, %
-- returns: next_turns UInt64 | requests whose predecessor is the previous turn of their conversation or agent run (predecessor_kind previous_turn) and that the predecessor's pod served
-- returns: hold_ms Float64 | the hold time that keeps X % of next turns warm: the ⌈X/100·n⌉-th smallest gap between a turn and its next turn (nearest rank, as turn_gaps), ms
-- returns: warm_turns UInt64 | next turns whose gap is at most hold_ms (at least X % of next_turns)
-- returns: held_tokens Nullable(Float64) | tokens a waiting run holds: the previous turn's prompt tokens, mean over next turns, tokens; NULL when no previous turn is in the gateway log
-- returns: held_blocks Nullable(Float64) | the full KV blocks of those tokens (⌊prompt tokens / block size⌋, the blocks vLLM caches), mean over next turns, blocks
-- returns: bytes_per_token Nullable(Float64) | KV-cache bytes per token used, mean over next turns: the pod's kv_cache_memory_bytes / kv_cache_size_tokens (vllm:cache_config_info), else kv_bytes_per_token; NULL when neither is known
-- returns: retained_bytes Nullable(Float64) | what holding one waiting run's prefix costs: held tokens × bytes per token, mean over next turns, bytes; NULL when bytes per token are unknown
-- returns: held_block_seconds Float64 | KV blocks taken from other traffic over the window by holding each previous turn's prefix for hold_ms: Σ over next turns of held blocks × min(gap, hold_ms), block-seconds (a lower bound: a run's last turn, which has no next turn, is held too)
--
-- Reads request_attribution's current answers (a row with sign +1 that no sign -1 row of the same version
-- cancels, sql/migrations/0009), the previous turns' prompt tokens from gateway_requests and each pod's latest
-- vllm_cache_config before `until` (bytes_per_token = kv_cache_memory_bytes / kv_cache_size_tokens, vLLM >= 0.32,
-- sql/migrations/0011). gap_ms runs from the previous turn's end (its ts + e2e_ms), so a previous turn is looked
-- up from a day before the earliest gap on (one that ran longer than a day counts as not found). Turns on another pod than their previous turn are left out (routed_away: no pod held
-- the prefix for them). A turn counts as warm when its gap is at most the hold time: holding a prefix for
-- hold_ms keeps it until its next turn if that comes within hold_ms.
WITH
    cancelled AS
    (
        SELECT request_id, version FROM request_attribution
        WHERE sign = -1 AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
    ),
    turns AS
    (
        SELECT a.ts AS turn_ts, CAST(a.pod AS String) AS pod_name, a.predecessor_request_id AS predecessor,
               assumeNotNull(a.gap_ms) AS gap, greatest(a.block_size, 1) AS block
        FROM request_attribution AS a
        WHERE a.sign = 1 AND a.ts >= {since:DateTime64(3, 'UTC')} AND a.ts < {until:DateTime64(3, 'UTC')}
          AND a.predecessor_kind = 'previous_turn' AND a.predecessor_pod = a.pod AND a.gap_ms IS NOT NULL
          AND ({tenant:String} = '' OR a.tenant_id = {tenant:String})
          AND ({pod:String} = '' OR a.pod = {pod:String}) AND ({model:String} = '' OR a.model = {model:String})
          AND (a.request_id, a.version) NOT IN (SELECT request_id, version FROM cancelled)
    ),
    (SELECT min(turn_ts - toIntervalMillisecond(toInt64(ceil(gap)))) - INTERVAL 1 DAY FROM turns) AS first_predecessor_ts,
    predecessors AS
    (
        SELECT request_id, any(prompt_tokens) AS prompt
        FROM gateway_requests
        WHERE ts >= first_predecessor_ts AND ts < {until:DateTime64(3, 'UTC')}
          AND request_id IN (SELECT predecessor FROM turns)
        GROUP BY request_id
    ),
    config AS
    (
        SELECT CAST(pod AS String) AS pod_name, argMax(bytes_per_token, ts) AS pod_bytes_per_token
        FROM vllm_cache_config
        WHERE ts < {until:DateTime64(3, 'UTC')} AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name
    ),
    waits AS
    (
        SELECT t.gap AS gap,
               if(p.request_id = '', NULL, toFloat64(p.prompt)) AS tokens,
               if(p.request_id = '', NULL, toFloat64(intDiv(p.prompt, t.block))) AS blocks,
               multiIf(c.pod_bytes_per_token > 0, c.pod_bytes_per_token,
                       {kv_bytes_per_token:Float64} > 0, {kv_bytes_per_token:Float64}, NULL) AS per_token
        FROM turns AS t
        LEFT JOIN predecessors AS p ON t.predecessor = p.request_id
        LEFT JOIN config AS c ON t.pod_name = c.pod_name
    ),
    holds AS
    (
        SELECT pct, n, gaps[intDiv(toUInt64(pct) * n + 99, 100)] AS hold
        FROM (SELECT count() AS n, arraySort(groupArray(gap)) AS gaps FROM waits)
        ARRAY JOIN {percents:Array(UInt8)} AS pct
        WHERE n > 0 AND pct BETWEEN 1 AND 100
    )
SELECT
    toUInt8(h.pct) AS percent,
    toUInt64(any(h.n)) AS next_turns,
    toFloat64(any(h.hold)) AS hold_ms,
    countIf(w.gap <= h.hold) AS warm_turns,
    CAST(avg(w.tokens) AS Nullable(Float64)) AS held_tokens,
    CAST(avg(w.blocks) AS Nullable(Float64)) AS held_blocks,
    CAST(avg(w.per_token) AS Nullable(Float64)) AS bytes_per_token,
    CAST(avg(w.tokens * w.per_token) AS Nullable(Float64)) AS retained_bytes,
    toFloat64(sum(ifNull(w.blocks, 0) * least(w.gap, h.hold)) / 1000) AS held_block_seconds
FROM holds AS h
CROSS JOIN waits AS w
GROUP BY h.pct
ORDER BY percent
