    -- part next_turns: the next turns of conversations and agent runs in the window, for the TTL queries
    -- (docs/ttl.md). Reads the parameters since, until, tenant, pod and model. Defines:
    --   cancelled: (request_id, ts, version) of the answers replaced in the window (sign -1, sql/migrations/0009);
    --   next_turns: one row per current answer (sign +1, not cancelled) arriving in the window whose predecessor
    --     is the previous turn of its conversation or agent run (predecessor_kind previous_turn, gap_ms known),
    --     of tenant, served by pod and of model ('' = all): request_id, turn_ts, tenant_name, model_name,
    --     pod_name, predecessor (its request id), same_pod (the predecessor's pod served it too), gap (ms, from
    --     the previous turn's end), block (KV block size, at least 1), evicted_tokens (missed tokens of cause
    --     evicted, any sub-cause), wait_evicted_tokens (those of sub-cause evicted_before_next_turn),
    --     not_reported (the pod did not report its cached count);
    --   first_predecessor_ts: a day before the earliest previous-turn end, where the previous turns are looked up
    --     in gateway_requests (one that ran longer than a day counts as not found);
    --   turn_log: the gateway log of the next turns and their previous turns: request_id, ts, prompt (prompt
    --     tokens), conversation, agent_run; one row per log line, not grouped (a GROUP BY over every turn cost
    --     more than the rest of the query): join a next turn's own line with ANY LEFT JOIN on (request_id, ts),
    --     its previous turn's with ASOF LEFT JOIN on request_id and ts <= turn_ts (the latest line of that id
    --     at or before the next turn: ids can repeat across runs, and the attribution keeps no predecessor ts).
    cancelled AS
    (
        SELECT request_id, ts, version FROM request_attribution
        WHERE sign = -1 AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
    ),
    next_turns AS
    (
        SELECT a.request_id AS request_id, a.ts AS turn_ts, CAST(a.tenant_id AS String) AS tenant_name,
               CAST(a.model AS String) AS model_name, CAST(a.pod AS String) AS pod_name,
               a.predecessor_request_id AS predecessor, a.predecessor_pod = a.pod AS same_pod,
               assumeNotNull(a.gap_ms) AS gap, greatest(a.block_size, 1) AS block,
               arraySum((c, n) -> if(c = 'evicted', toUInt64(n), 0), a.causes, a.missed_tokens) AS evicted_tokens,
               arraySum((c, s, n) -> if(c = 'evicted' AND s = 'evicted_before_next_turn', toUInt64(n), 0),
                        a.causes, a.sub_causes, a.missed_tokens) AS wait_evicted_tokens,
               has(a.causes, 'not_reported') AS not_reported
        FROM request_attribution AS a
        WHERE a.sign = 1 AND a.ts >= {since:DateTime64(3, 'UTC')} AND a.ts < {until:DateTime64(3, 'UTC')}
          AND a.predecessor_kind = 'previous_turn' AND a.gap_ms IS NOT NULL
          AND ({tenant:String} = '' OR a.tenant_id = {tenant:String})
          AND ({pod:String} = '' OR a.pod = {pod:String}) AND ({model:String} = '' OR a.model = {model:String})
          AND (a.request_id, a.ts, a.version) NOT IN (SELECT request_id, ts, version FROM cancelled)
    ),
    (SELECT min(turn_ts - toIntervalMillisecond(toInt64(ceil(gap)))) - INTERVAL 1 DAY FROM next_turns)
        AS first_predecessor_ts,
    turn_log AS
    (
        SELECT request_id, ts, prompt_tokens AS prompt, conversation_id AS conversation, agent_run_id AS agent_run
        FROM gateway_requests
        WHERE ts >= first_predecessor_ts AND ts < {until:DateTime64(3, 'UTC')}
          AND request_id IN (SELECT arrayJoin([predecessor, request_id]) FROM next_turns)
    ),
