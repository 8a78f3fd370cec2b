-- name: request_detail
-- description: One request's miss attribution with its evidence, one row per prompt segment in prompt order (system, tools, retrieval, history, suffix): its causes, its predecessor (id, arrival, pod, how it was found, gap), the block size, the first segment whose hash differs from the predecessor's, each segment's token counts and whether it matched, which system lines and message chunks differ, what re-computing the missed tokens cost, and the KV events of the predecessor's pod in between. Never prompt text or hashes.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window the request arrived in (inclusive), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id of the request, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: model: String = '' | model of the request ('' = all); also the vLLM model_name whose prefill time prices the misses
-- param: request_id: String = '' | gateway request id; '' = the request with the most missed tokens in the window and filters (latest first on a tie)
-- returns: request_id String | gateway request id
-- returns: ts DateTime64(3, 'UTC') | the request's arrival at the gateway, UTC
-- returns: tenant_id String | tenant
-- returns: pod String | pod that served the request
-- returns: model String | model
-- returns: prompt_tokens UInt64 | the request's prompt tokens, tokens
-- returns: cached_tokens Nullable(UInt64) | the request's cached tokens (NULL: the pod did not report it)
-- returns: block_size UInt32 | KV block size the attribution used (the pod's vllm:cache_config_info), tokens
-- returns: causes Array(String) | miss causes of the request in prompt order (parallel to sub_causes and cause_missed_tokens)
-- returns: sub_causes Array(String) | sub-cause of each cause ('' if none)
-- returns: cause_missed_tokens Array(UInt64) | missed tokens of each cause, tokens; they sum to prompt_tokens - cached_tokens (all prompt tokens for not_reported)
-- returns: cause_gpu_seconds Array(Nullable(Float64)) | what re-computing each cause's missed tokens cost: tokens × the pod's measured prefill seconds per computed token in the window (else the fleet's), GPU-seconds, as miss_causes; NULL when no pod measured prefill time in the window, and for not_reported (hits unknown: no miss known, no cost)
-- returns: gpu_seconds Nullable(Float64) | the same for all the request's missed tokens (Σ cause_gpu_seconds), GPU-seconds; NULL for a not_reported request
-- returns: predecessor_request_id String | the request whose prefix this one could have reused ('' if none within the lookback)
-- returns: predecessor_ts Nullable(DateTime64(3, 'UTC')) | the predecessor's arrival, UTC (NULL if none or its log row is gone)
-- returns: predecessor_pod String | pod that served the predecessor ('' if none)
-- returns: predecessor_kind String | how the predecessor was found: previous_turn (same conversation or agent run), fingerprint (same prompt fingerprint), variant (same normalized system prompt, canonical tools or retrieval set); with the suffix _beyond_horizon (e.g. previous_turn_beyond_horizon) when no predecessor lay within the horizon and this one was found further back, within the lookback; '' if none
-- returns: gap_ms Nullable(Float64) | predecessor end (its arrival + e2e) to this request's arrival, ms (NULL if none)
-- returns: evidence String | what the routed_away / evicted part rests on: kv_events (the request's block chain matched against the pods' KV events, precise mode), inferred (concluded from the predecessor's pod), fingerprints (segment hashes alone: no routed_away / evicted part)
-- returns: evidence_pod String | kv_events: the pod that held the first missed block (the holder for routed_away, this pod for evicted); '' otherwise
-- returns: evidence_removed_at Nullable(DateTime64(3, 'UTC')) | kv_events: when that block left this pod (evicted, by a BlockRemoved or a cache reset), UTC; NULL otherwise
-- returns: pods_down Array(String) | the pods the gateway found down when it routed the request (gateway_requests.pods_down): a routed_away part held on one of them reads pod_down; [] when none was or the gateway does not log it
-- returns: changed_segment String | the first segment, in prompt order, whose hash differs from the predecessor's (system, tools, retrieval, history, suffix); '' if none differs or there is no predecessor
-- returns: kv_events UInt64 | KV-cache events (vLLM BlockStored/BlockRemoved/AllBlocksCleared) the predecessor's pod sent after the predecessor arrived and up to this request's arrival; 0 also when the pod sends none (the cause is then inferred from which pod served the predecessor)
-- returns: kv_blocks_stored UInt64 | blocks in those BlockStored events, blocks
-- returns: kv_blocks_removed UInt64 | blocks in those BlockRemoved events (evictions), blocks
-- returns: kv_caches_cleared UInt64 | AllBlocksCleared events among them
-- returns: segment String | prompt segment: system, tools, retrieval, history or suffix (the new message)
-- returns: segment_index UInt8 | 1..5, prompt order
-- returns: segment_tokens UInt64 | the segment's tokens in this request (gateway count, chat-template tokens excluded), tokens
-- returns: predecessor_segment_tokens Nullable(UInt64) | the segment's tokens in the predecessor (NULL if none or its log row is gone), tokens
-- returns: hash_matched Nullable(UInt8) | 1 if the segment's hash equals the predecessor's (two empty segments match), 0 if not, NULL without a predecessor row
-- returns: variant_matched Nullable(UInt8) | when the hash differs, whether the change is nameable: 1 if the normalized system prompt / canonical tools / retrieval set equals the predecessor's (volatile values masked, reordered), for history 1 if it continues the predecessor's conversation (a previous_turn whose history this one extends, its final message as it was sent, or completed when it was an assistant prefill), else 0; NULL when the hash matched, for suffix, or without a predecessor row
-- returns: segment_parts UInt32 | the segment's parts the gateway logged: system lines (system_line_hashes) for system, content-defined chunks of the new message (suffix_chunk_hashes) for suffix; 0 for the other segments or when none were logged
-- returns: predecessor_segment_parts Nullable(UInt32) | the same count in the predecessor (NULL if none or its log row is gone)
-- returns: changed_parts Array(UInt32) | 1-based positions of this request's lines / chunks whose hash differs from the predecessor's at the same position (a position past the predecessor's last counts); [] when none differs, without a predecessor row, or when either side logged none
-- returns: changed_part_tokens Array(UInt64) | tokens of each of those lines / chunks in this request (parallel to changed_parts), tokens
-- returns: changed_part_moved Array(UInt8) | 1 if the predecessor's segment held that line / chunk at another position (moved: reordered), 0 if it is new (parallel to changed_parts)
-- returns: segment_missed_tokens Nullable(UInt64) | missed tokens [cached_tokens, prompt_tokens) that fall in this segment, segment boundaries scaled to prompt_tokens as the attribution places them, tokens (NULL when cached is not reported or the log has no segment counts)
--
-- The current answer is the request_attribution row with sign +1 that no row with sign -1 of the same request
-- (request_id, ts: ids can repeat across runs) and version cancels (sql/migrations/0009). The request's and predecessor's gateway rows give the per-segment hashes and
-- token counts: the same comparison ingest/attribution.py shared_prefix() walks (docs/miss-causes.md). Segment
-- boundaries: cumulative segment counts × prompt_tokens / Σ segment counts, floored (attribution
-- segment_offsets()). KV events are read from kv_block_events FINAL (a re-sent ZMQ batch counted once; an
-- event sent in pieces, sql/migrations/0029, counted once: by its piece with first_pos 0), on the predecessor's pod, from the predecessor's arrival (else its end, arrival - gap_ms) to this arrival. Lines
-- and chunks are compared position by position, as ingest/attribution.py first_changed_line_tokens() and
-- suffix_chunk_drift() walk them (sql/migrations/0020). GPU-seconds: the part sql/parts/prefill_cost.sql.
WITH
    -- include: prefill_cost
    cancelled AS
    (
        SELECT request_id, ts, version FROM request_attribution
        WHERE sign = -1 AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({request_id:String} = '' OR request_id = {request_id:String})
    ),
    answer AS
    (
        SELECT request_id, ts, CAST(tenant_id AS String) AS tenant_id, CAST(pod AS String) AS pod,
               CAST(model AS String) AS model, toUInt64(prompt_tokens) AS prompt_tokens,
               CAST(cached_tokens AS Nullable(UInt64)) AS cached_tokens, block_size,
               CAST(causes AS Array(String)) AS causes, CAST(sub_causes AS Array(String)) AS sub_causes,
               CAST(missed_tokens AS Array(UInt64)) AS cause_missed_tokens, predecessor_request_id,
               CAST(predecessor_pod AS String) AS predecessor_pod,
               CAST(predecessor_kind AS String) AS predecessor_kind, gap_ms, CAST(evidence AS String) AS evidence,
               CAST(evidence_pod AS String) AS evidence_pod, evidence_removed_at
        FROM request_attribution
        WHERE sign = 1 AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({request_id:String} = '' OR request_id = {request_id:String})
          AND ({tenant:String} = '' OR tenant_id = {tenant:String})
          AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
          AND (request_id, ts, version) NOT IN (SELECT request_id, ts, version FROM cancelled)
        ORDER BY arraySum(missed_tokens) DESC, ts DESC, request_id
        LIMIT 1
    ),
    req AS
    (
        SELECT request_id, system_hash, system_norm_hash, system_tokens, tools_hash, tools_canonical_hash,
               tools_tokens, retrieval_pack_hash, retrieval_set_hash, retrieval_tokens, history_prefix_hash,
               prev_history_hash, prev_suffix_hash, prefill_history_hash, history_tokens, suffix_hash, suffix_tokens,
               system_line_hashes, system_line_tokens, suffix_chunk_hashes, suffix_chunk_tokens, pods_down
        FROM gateway_requests
        WHERE (tenant_id, ts, request_id) IN (SELECT tenant_id, ts, request_id FROM answer)
        LIMIT 1
    ),
    pred AS
    (
        SELECT request_id, ts, system_hash, system_norm_hash, system_tokens, tools_hash, tools_canonical_hash,
               tools_tokens, retrieval_pack_hash, retrieval_set_hash, retrieval_tokens, history_prefix_hash,
               history_tokens, suffix_hash, suffix_tokens, next_history_hash, continue_final_message,
               prev_history_hash, system_line_hashes, suffix_chunk_hashes
        FROM gateway_requests
        WHERE request_id IN (SELECT predecessor_request_id FROM answer WHERE predecessor_request_id != '')
          -- gap_ms = arrival - (predecessor arrival + its e2e_ms), e2e_ms >= 0: the predecessor arrived by
          -- arrival - gap_ms (1 s of slack); a previous_turn or variant predecessor is of the same tenant.
          AND ts <= (SELECT any(ts - toIntervalMillisecond(toInt64(floor(ifNull(gap_ms, 0))) - 1000)) FROM answer)
          AND (startsWith((SELECT any(predecessor_kind) FROM answer), 'fingerprint')
               OR tenant_id = (SELECT any(tenant_id) FROM answer))
        ORDER BY ts DESC
        LIMIT 1
    ),
    detail AS
    (
        SELECT
            a.request_id AS request_id, a.ts AS ts, a.tenant_id AS tenant_id, a.pod AS pod, a.model AS model,
            a.prompt_tokens AS prompt_tokens, a.cached_tokens AS cached_tokens, a.block_size AS block_size,
            a.causes AS causes, a.sub_causes AS sub_causes, a.cause_missed_tokens AS cause_missed_tokens,
            a.predecessor_request_id AS predecessor_request_id, a.predecessor_pod AS predecessor_pod,
            a.predecessor_kind AS predecessor_kind, a.gap_ms AS gap_ms, a.evidence AS evidence,
            a.evidence_pod AS evidence_pod, a.evidence_removed_at AS evidence_removed_at,
            p.request_id != '' AS has_pred, arrayMap(x -> CAST(x AS String), r.pods_down) AS pods_down,
            if(has_pred, CAST(p.ts AS Nullable(DateTime64(3, 'UTC'))), NULL) AS pred_ts,
            ['system', 'tools', 'retrieval', 'history', 'suffix'] AS names,
            [r.system_hash, r.tools_hash, r.retrieval_pack_hash, r.history_prefix_hash, r.suffix_hash] AS r_hash,
            [p.system_hash, p.tools_hash, p.retrieval_pack_hash, p.history_prefix_hash, p.suffix_hash] AS p_hash,
            [r.system_norm_hash, r.tools_canonical_hash, r.retrieval_set_hash] AS r_variant,
            [p.system_norm_hash, p.tools_canonical_hash, p.retrieval_set_hash] AS p_variant,
            arrayMap(x -> toUInt64(x),
                     [r.system_tokens, r.tools_tokens, r.retrieval_tokens, r.history_tokens, r.suffix_tokens])
                AS r_tokens,
            arrayMap(x -> toUInt64(x),
                     [p.system_tokens, p.tools_tokens, p.retrieval_tokens, p.history_tokens, p.suffix_tokens])
                AS p_tokens,
            [r.system_line_hashes, [], [], [], r.suffix_chunk_hashes] AS r_parts,
            [r.system_line_tokens, [], [], [], r.suffix_chunk_tokens] AS r_part_tokens,
            [p.system_line_hashes, [], [], [], p.suffix_chunk_hashes] AS p_parts,
            -- per segment, the positions (1-based) whose line / chunk hash differs from the predecessor's
            arrayMap((rh, ph) -> if(has_pred AND NOT empty(ph),
                                    arrayFilter(j -> j > length(ph) OR rh[j] != ph[j], arrayEnumerate(rh)), []),
                     r_parts, p_parts) AS changed_at,
            -- a next turn: the previous turn's history kept and its final message as sent (a predecessor logged
            -- without segments proves no edit), its messages re-sent with no reply between (next_history_hash), or
            -- its assistant prefill carried completed (continue_final_message, prefill_history_hash), or a turn back
            -- (a regenerate or an edit of an earlier message: this history is the one its previous turn had)
            startsWith(a.predecessor_kind, 'previous_turn')
                AND ((r.prev_history_hash = p.history_prefix_hash
                      AND (r.prev_suffix_hash = '' OR p.suffix_hash = '' OR r.prev_suffix_hash = p.suffix_hash))
                     OR (p.next_history_hash != '' AND r.history_prefix_hash = p.next_history_hash)
                     OR (p.continue_final_message AND r.prefill_history_hash != ''
                         AND r.prefill_history_hash = p.history_prefix_hash)
                     OR r.history_prefix_hash = p.prev_history_hash) AS continues,
            arraySum(r_tokens) AS total,
            arrayMap(c -> if(total = 0, 0, intDiv(c * a.prompt_tokens, total)), arrayCumSum(r_tokens)) AS ends,
            arrayPushFront(arrayPopBack(ends), 0) AS starts
        FROM answer AS a
        LEFT JOIN req AS r ON r.request_id = a.request_id
        LEFT JOIN pred AS p ON p.request_id = a.predecessor_request_id
    ),
    kv AS
    (
        SELECT countIf(first_pos = 0) AS kv_events,
               sumIf(length(block_hashes), event_type = 'BlockStored') AS kv_blocks_stored,
               sumIf(length(block_hashes), event_type = 'BlockRemoved') AS kv_blocks_removed,
               countIf(event_type = 'AllBlocksCleared') AS kv_caches_cleared
        FROM kv_block_events FINAL
        WHERE pod != '' AND pod = (SELECT any(predecessor_pod) FROM answer)
          AND ts > (SELECT any(ifNull(pred_ts, ts - toIntervalMillisecond(toInt64(ifNull(gap_ms, 0)))))
                    FROM detail)
          AND ts <= (SELECT any(ts) FROM answer)
    )
SELECT
    d.request_id AS request_id, d.ts AS ts, d.tenant_id AS tenant_id, d.pod AS pod, d.model AS model,
    d.prompt_tokens AS prompt_tokens, d.cached_tokens AS cached_tokens, d.block_size AS block_size,
    d.causes AS causes, d.sub_causes AS sub_causes, d.cause_missed_tokens AS cause_missed_tokens,
    arrayMap((c, n) -> if(c = 'not_reported', NULL, n * seconds_per_token_on(d.pod)), d.causes,
             d.cause_missed_tokens) AS cause_gpu_seconds,
    if(has(d.causes, 'not_reported'), NULL,
       arraySum(d.cause_missed_tokens) * seconds_per_token_on(d.pod)) AS gpu_seconds,
    d.predecessor_request_id AS predecessor_request_id, d.pred_ts AS predecessor_ts,
    d.predecessor_pod AS predecessor_pod, d.predecessor_kind AS predecessor_kind, d.gap_ms AS gap_ms,
    d.evidence AS evidence, d.evidence_pod AS evidence_pod, d.evidence_removed_at AS evidence_removed_at,
    d.pods_down AS pods_down,
    if(d.has_pred, d.names[arrayFirstIndex((x, y) -> x != y, d.r_hash, d.p_hash)], '') AS changed_segment,
    toUInt64(k.kv_events) AS kv_events, toUInt64(k.kv_blocks_stored) AS kv_blocks_stored,
    toUInt64(k.kv_blocks_removed) AS kv_blocks_removed, toUInt64(k.kv_caches_cleared) AS kv_caches_cleared,
    segment, toUInt8(i) AS segment_index, d.r_tokens[i] AS segment_tokens,
    if(d.has_pred, CAST(d.p_tokens[i] AS Nullable(UInt64)), NULL) AS predecessor_segment_tokens,
    if(d.has_pred, CAST(d.r_hash[i] = d.p_hash[i] AS Nullable(UInt8)), NULL) AS hash_matched,
    multiIf(NOT d.has_pred OR i = 5 OR d.r_hash[i] = d.p_hash[i], CAST(NULL AS Nullable(UInt8)),
            i = 4, toUInt8(d.continues),
            toUInt8(d.r_variant[i] != '' AND d.r_variant[i] = d.p_variant[i])) AS variant_matched,
    toUInt32(length(d.r_parts[i])) AS segment_parts,
    if(d.has_pred, CAST(length(d.p_parts[i]) AS Nullable(UInt32)), NULL) AS predecessor_segment_parts,
    arrayMap(j -> toUInt32(j), d.changed_at[i]) AS changed_parts,
    arrayMap(j -> toUInt64(d.r_part_tokens[i][j]), d.changed_at[i]) AS changed_part_tokens,
    arrayMap(j -> toUInt8(has(d.p_parts[i], d.r_parts[i][j])), d.changed_at[i]) AS changed_part_moved,
    if(d.cached_tokens IS NULL OR d.total = 0, CAST(NULL AS Nullable(UInt64)),
       toUInt64(greatest(0, toInt64(d.ends[i]) - toInt64(greatest(d.starts[i], assumeNotNull(d.cached_tokens))))))
        AS segment_missed_tokens
FROM detail AS d
CROSS JOIN kv AS k
ARRAY JOIN d.names AS segment, arrayEnumerate(d.names) AS i
ORDER BY segment_index
