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
-- Reads request_attribution's current answers and the previous turns' prompt tokens from gateway_requests (the
-- part sql/parts/next_turns.sql, as ttl_runs) and each pod's bytes per token (sql/parts/kv_bytes_per_token.sql).
-- gap_ms runs from the previous turn's end (its ts + e2e_ms). Turns on another pod than their previous turn are
-- left out (routed_away: no pod held the prefix for them). A turn counts as warm when its gap is at most the hold
-- time: holding a prefix for hold_ms keeps it until its next turn if that comes within hold_ms.
-- A previous turn's log line is the latest of its request_id at or before the next turn's ts (request ids can
-- repeat across runs, and the attribution keeps the predecessor's id, not its ts): exact unless another request
-- reusing the id arrived between the previous turn and its next turn.
WITH
    -- include: next_turns
    -- include: kv_bytes_per_token
    waits AS
    (
        SELECT t.gap AS gap,
               if(p.request_id = '', NULL, toFloat64(p.prompt)) AS tokens,
               if(p.request_id = '', NULL, toFloat64(intDiv(p.prompt, t.block))) AS blocks,
               bytes_per_token_on(t.pod_name) AS per_token
        FROM next_turns AS t
        -- the predecessor's log line: the latest of its request_id at or before this turn (ids can repeat
        -- across runs; request_attribution keeps the predecessor's id, not its ts)
        ASOF LEFT JOIN turn_log AS p ON t.predecessor = p.request_id AND t.turn_ts >= p.ts
        WHERE t.same_pod
    ),
    all_waits AS
    (
        -- waits read once (a WITH subquery runs again wherever it is named): every percent from one array
        SELECT count() AS n, groupArray((gap, tokens, blocks, per_token)) AS w,
               arraySort(arrayMap(x -> x.1, w)) AS gaps
        FROM waits
    )
SELECT
    toUInt8(pct) AS percent,
    toUInt64(n) AS next_turns,
    toFloat64(gaps[intDiv(toUInt64(pct) * n + 99, 100)]) AS hold_ms,
    toUInt64(arrayCount(x -> x.1 <= hold_ms, w)) AS warm_turns,
    CAST(arrayReduce('avg', arrayMap(x -> x.2, w)) AS Nullable(Float64)) AS held_tokens,
    CAST(arrayReduce('avg', arrayMap(x -> x.3, w)) AS Nullable(Float64)) AS held_blocks,
    CAST(arrayReduce('avg', arrayMap(x -> x.4, w)) AS Nullable(Float64)) AS bytes_per_token,
    CAST(arrayReduce('avg', arrayMap(x -> x.2 * x.4, w)) AS Nullable(Float64)) AS retained_bytes,
    toFloat64(arraySum(x -> ifNull(x.3, 0) * least(x.1, hold_ms), w) / 1000) AS held_block_seconds
FROM all_waits
ARRAY JOIN {percents:Array(UInt8)} AS pct
WHERE n > 0 AND pct BETWEEN 1 AND 100
ORDER BY percent
