-- name: turn_gaps
-- description: How long a conversation or agent run waits between a turn and its next turn on the same pod (a tool call, the user's reply), the hold time that would keep 90 % of next turns warm, and how many next turns found their prefix evicted (evicted / evicted_before_next_turn): the digest's TTL recommendation.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the next turn's arrival), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served both turns, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: by_pod: UInt8 = 0 | 1 = one row per pod; 0 = pods pooled (pod '')
-- returns: pod String | pod that served both turns, or '' when by_pod = 0
-- returns: next_turns UInt64 | requests whose predecessor is the previous turn of their conversation or agent run (predecessor_kind previous_turn) and that the predecessor's pod served
-- returns: gap_p50_ms Float64 | median wait between a turn and its next turn, ms (nearest rank: the ⌈0.5·n⌉-th smallest gap)
-- returns: gap_p90_ms Float64 | the hold time that keeps 90 % of next turns warm: the ⌈0.9·n⌉-th smallest gap (nearest rank), ms
-- returns: gap_p99_ms Float64 | the ⌈0.99·n⌉-th smallest gap, ms
-- returns: gap_max_ms Float64 | longest gap, ms
-- returns: evicted_before_next_turn UInt64 | next turns whose prefix the pod no longer held (cause evicted, sub_cause evicted_before_next_turn)
-- returns: evicted_missed_tokens UInt64 | their missed tokens of that cause, tokens
-- returns: evicted_gap_p50_ms Nullable(Float64) | median gap of those evicted next turns (nearest rank), ms: the pods held prefixes for less than this; NULL when none was evicted
--
-- Reads request_attribution's current answers (the part sql/parts/next_turns.sql, as ttl_survival and
-- ttl_hold_time): the turns the previous turn's pod served. Percentiles are exact (nearest-rank method: the
-- smallest gap g with at least q·n gaps ≤ g), computed over the sorted gaps of the window.
WITH
    -- include: next_turns
    turns AS
    (
        SELECT if({by_pod:UInt8} = 1, pod_name, '') AS pod_group, gap, wait_evicted_tokens AS evicted_tokens,
               evicted_tokens > 0 AS evicted
        FROM next_turns
        WHERE same_pod
    )
SELECT
    pod_group AS pod,
    n AS next_turns,
    gaps[intDiv(n + 1, 2)] AS gap_p50_ms,
    gaps[intDiv(9 * n + 9, 10)] AS gap_p90_ms,
    gaps[intDiv(99 * n + 99, 100)] AS gap_p99_ms,
    gaps[n] AS gap_max_ms,
    n_evicted AS evicted_before_next_turn,
    tokens_evicted AS evicted_missed_tokens,
    CAST(if(n_evicted > 0, evicted_gaps[intDiv(n_evicted + 1, 2)], NULL) AS Nullable(Float64)) AS evicted_gap_p50_ms
FROM
(
    SELECT pod_group, count() AS n, arraySort(groupArray(gap)) AS gaps, countIf(evicted) AS n_evicted,
           sum(evicted_tokens) AS tokens_evicted, arraySort(groupArrayIf(gap, evicted)) AS evicted_gaps
    FROM turns
    GROUP BY pod_group
)
ORDER BY pod
