-- name: ttl_survival
-- description: Did a conversation's or agent run's prefix survive the wait before its next turn? Per tenant, model and gap bucket (the wait before the turn, log-spaced: <1s, 1-5s, 5-15s, 15-60s, 1-5m, 5-15m, 15-60m, >1h), the next turns that the previous turn's pod served, those whose prefix survived (no missed token of cause evicted) and the survival share: the survival curve by gap.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the next turn's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served both turns, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: tenant_id String | tenant
-- returns: model String | model (the gateway log's `model`)
-- returns: gap_bucket String | the wait before the turn: '<1s' [0, 1 s), '1-5s' [1 s, 5 s), '5-15s', '15-60s', '1-5m', '5-15m', '15-60m' [15 min, 1 h), '>1h' (1 h and more)
-- returns: bucket_index UInt8 | 0 for '<1s' … 7 for '>1h', to sort the buckets by gap
-- returns: bucket_start_ms Float64 | the bucket's shortest gap, ms (inclusive)
-- returns: turns UInt64 | next turns in the bucket: requests whose predecessor is the previous turn of their conversation or agent run (predecessor_kind previous_turn), on the pod that served it, whose pod reported the cached count
-- returns: survived_turns UInt64 | of those, the turns with no missed token of cause evicted (the pod still held the whole reusable prefix)
-- returns: survival_share Float64 | survived_turns / turns, fraction 0..1
-- returns: evicted_missed_tokens UInt64 | the missed tokens of cause evicted (sub-cause evicted_before_next_turn) of the bucket's turns, tokens
-- returns: gpu_seconds Nullable(Float64) | what re-computing those evicted tokens cost: per pod, tokens × the pod's measured prefill seconds per computed token in the window (else the fleet's), GPU-seconds; NULL when no pod measured prefill time in the window
--
-- Reads request_attribution's current answers (the part sql/parts/next_turns.sql, as turn_gaps). A turn served by
-- another pod than its previous turn is left out (its miss is routed_away: it says nothing about how long a pod
-- held the prefix), and so is a turn whose pod did not report its cached count (not_reported: whether it
-- survived is unknown). Prefill cost per token: the part sql/parts/prefill_cost.sql, as miss_causes.
WITH
    -- include: next_turns
    -- include: prefill_cost
    turns AS
    (
        SELECT tenant_name, model_name, pod_name, gap, evicted_tokens,
               multiIf(gap < 1000, 0, gap < 5000, 1, gap < 15000, 2, gap < 60000, 3, gap < 300000, 4,
                       gap < 900000, 5, gap < 3600000, 6, 7) AS bucket
        FROM next_turns
        WHERE same_pod AND NOT not_reported
    )
SELECT
    tenant_name AS tenant_id,
    model_name AS model,
    CAST(['<1s', '1-5s', '5-15s', '15-60s', '1-5m', '5-15m', '15-60m', '>1h'][bucket + 1] AS String) AS gap_bucket,
    toUInt8(bucket) AS bucket_index,
    CAST([0, 1000, 5000, 15000, 60000, 300000, 900000, 3600000][bucket + 1] AS Float64) AS bucket_start_ms,
    count() AS turns,
    countIf(evicted_tokens = 0) AS survived_turns,
    survived_turns / turns AS survival_share,
    sum(evicted_tokens) AS evicted_missed_tokens,
    sum(evicted_tokens * seconds_per_token_on(pod_name)) AS gpu_seconds
FROM turns
GROUP BY tenant_name, model_name, bucket
ORDER BY tenant_id, model, bucket_index
