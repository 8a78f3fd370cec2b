-- name: alert_state
-- description: The current state of every alert rule (its latest evaluation): firing or ok, since when, its value beside its threshold, the message and the evidence.
-- returns: rule String | the rule's name (KVSCOPE_ALERT_RULES or the built-in rules, docs/alerts.md)
-- returns: kind String | hit_rate_drop, cause_share, cardinality_jump or source_silent
-- returns: severity String | info, warning or critical
-- returns: state String | firing or ok
-- returns: value Nullable(Float64) | what the rule measured, in the kind's unit (hit_rate_drop: pp; cause_share: percent of missed tokens; cardinality_jump: factor; source_silent: seconds since the latest row); NULL when there was nothing to measure
-- returns: threshold Float64 | the rule's threshold, in the same unit
-- returns: message String | one sentence on what was found
-- returns: evidence String | JSON object: affected tenants or pods, cause, sub_cause, an example request with its predecessor, pod and changed segment, the fix (docs/alerts.md)
-- returns: evaluated_at DateTime64(3, 'UTC') | when the rule was last evaluated, UTC
-- returns: changed_at DateTime64(3, 'UTC') | when the rule entered its current state, UTC
--
-- Reads alert_state (sql/migrations/0015), append-only: the latest row of each rule by evaluated_at.
SELECT rule, kind, severity, state, value, threshold, message, evidence, evaluated_at, changed_at
FROM
(
    SELECT
        CAST(rule AS String) AS rule,
        CAST(argMax(a.kind, a.evaluated_at) AS String) AS kind,
        CAST(argMax(a.severity, a.evaluated_at) AS String) AS severity,
        CAST(argMax(a.state, a.evaluated_at) AS String) AS state,
        argMax(a.value, a.evaluated_at) AS value,
        argMax(a.threshold, a.evaluated_at) AS threshold,
        argMax(a.message, a.evaluated_at) AS message,
        argMax(a.evidence, a.evaluated_at) AS evidence,
        max(a.evaluated_at) AS evaluated_at,
        argMax(a.changed_at, a.evaluated_at) AS changed_at
    FROM alert_state AS a
    GROUP BY a.rule
)
ORDER BY state = 'firing' DESC, indexOf(['critical', 'warning', 'info'], severity), rule
