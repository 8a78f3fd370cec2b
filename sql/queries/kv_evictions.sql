-- name: kv_evictions
-- description: Per pod and engine over a window, what left the KV cache and how, by vLLM's KV events: BlockRemoved events and blocks, blocks that left the pod (evicted), prefix-cache resets (AllBlocksCleared) and vLLM restarts and the blocks they emptied, how long evicted blocks had been resident, and how many were evicted with no sign of reuse.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the event's time), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: pod: String = '' | pod to keep, '' = all
-- returns: pod String | pod name: every pod with KV events in the window, and every pod with vLLM metrics in it (kv_events 0 for those without)
-- returns: engine String | vLLM data-parallel rank ('' when the pod publishes none, or sends no KV events)
-- returns: kv_events UInt64 | KV events (BlockStored, BlockRemoved, AllBlocksCleared) in the window; 0 = no KV events: nothing below is evidence
-- returns: blocks_stored UInt64 | blocks in BlockStored events, blocks (a second copy of a resident hash included)
-- returns: block_removed_events UInt64 | BlockRemoved events
-- returns: blocks_removed UInt64 | blocks in those BlockRemoved events, blocks (one per copy removed)
-- returns: evicted_blocks UInt64 | block hashes that left the pod and engine through a BlockRemoved (their last copy removed): residency intervals of kv_block_residency ended by block_removed in the window
-- returns: caches_cleared UInt64 | AllBlocksCleared events (vLLM's reset_prefix_cache)
-- returns: restarts UInt64 | vLLM starts seen (kv_cache_resets kind restart): a publisher's first batch, or the first batch stored after a publisher_restart gap that lost batches (kv_gaps)
-- returns: blocks_reset UInt64 | block hashes emptied by those clears and restarts, blocks
-- returns: mean_residency_seconds Nullable(Float64) | mean of removed_at − stored_at over the evicted blocks whose store is in the events, seconds (NULL when none)
-- returns: removed_before_reuse UInt64 | evicted blocks with no sign of reuse while resident: stored once, and no block stored on top of them (a BlockStored naming them as parent) in a later batch
--
-- Reads kv_block_events, kv_block_log, kv_cache_resets and kv_block_residency (sql/migrations/0017;
-- docs/kv-events.md). An event sent in pieces (cut between blocks to fit a Kafka message, sql/migrations/0029)
-- counts once: by its piece with first_pos 0. vLLM publishes no event for a cache hit (unless a request asks for
-- kv_cache_report_mode "full"), so reuse is seen only when a later request stores more blocks on top of a block,
-- or stores it again; a decode step filling a block after a prompt's last one counts as on top of it too.
WITH
    pods AS
    (
        SELECT DISTINCT CAST(pod AS String) AS pod_name, CAST(engine AS String) AS engine_name
        FROM kv_block_events
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        UNION DISTINCT
        SELECT DISTINCT CAST(pod AS String), ''
        FROM vllm_metrics
        WHERE name = 'vllm:num_requests_running' AND ts >= {since:DateTime64(3, 'UTC')}
          AND ts < {until:DateTime64(3, 'UTC')} AND ({pod:String} = '' OR pod = {pod:String})
          AND pod NOT IN (SELECT pod FROM kv_block_events
                          WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')})
    ),
    events AS
    (
        SELECT CAST(pod AS String) AS pod_name, CAST(engine AS String) AS engine_name, countIf(first_pos = 0) AS n,
               sumIf(length(block_hashes), event_type = 'BlockStored') AS stored,
               countIf(event_type = 'BlockRemoved' AND first_pos = 0) AS removed_events,
               sumIf(length(block_hashes), event_type = 'BlockRemoved') AS removed,
               countIf(event_type = 'AllBlocksCleared') AS cleared
        FROM kv_block_events
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name, engine_name
    ),
    restarts AS
    (
        SELECT pod AS pod_name, engine AS engine_name, count() AS n
        FROM kv_cache_resets
        WHERE kind = 'restart' AND ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name, engine_name
    ),
    ended AS
    (
        SELECT CAST(pod AS String) AS pod_name, CAST(engine AS String) AS engine_name, CAST(medium AS String) AS medium_name,
               block_hash, stored_at, assumeNotNull(removed_at) AS removed, removed_by, stores
        FROM kv_block_residency
        WHERE removed_at >= {since:DateTime64(3, 'UTC')} AND removed_at < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
    ),
    on_top AS
    (
        SELECT e.pod_name AS pod_name, e.engine_name AS engine_name, e.medium_name AS medium_name,
               e.block_hash AS block_hash, e.removed AS removed, toUInt8(1) AS reused
        FROM ended AS e
        INNER JOIN
        (
            SELECT CAST(pod AS String) AS pod_name, CAST(engine AS String) AS engine_name,
                   CAST(medium AS String) AS medium_name, assumeNotNull(parent_block_hash) AS parent, ts
            FROM kv_block_log FINAL
            WHERE kind = 'stored' AND pos = 0 AND parent_block_hash IS NOT NULL
              AND ts < {until:DateTime64(3, 'UTC')} AND ({pod:String} = '' OR pod = {pod:String})
        ) AS c ON c.pod_name = e.pod_name AND c.engine_name = e.engine_name AND c.medium_name = e.medium_name
                  AND c.parent = e.block_hash
        WHERE e.removed_by = 'block_removed' AND c.ts > ifNull(e.stored_at, toDateTime64(0, 3, 'UTC'))
          AND c.ts <= e.removed
        GROUP BY pod_name, engine_name, medium_name, block_hash, removed
    ),
    evictions AS
    (
        SELECT e.pod_name AS pod_name, e.engine_name AS engine_name,
               countIf(e.removed_by = 'block_removed') AS evicted,
               countIf(e.removed_by IN ('all_blocks_cleared', 'pod_restart')) AS reset,
               avgIf(dateDiff('millisecond', assumeNotNull(e.stored_at), e.removed) / 1000,
                     e.removed_by = 'block_removed' AND e.stored_at IS NOT NULL) AS mean_seconds,
               countIf(e.removed_by = 'block_removed' AND e.stores = 1 AND t.reused = 0) AS unreused
        FROM ended AS e
        LEFT JOIN on_top AS t ON t.pod_name = e.pod_name AND t.engine_name = e.engine_name
                                 AND t.medium_name = e.medium_name AND t.block_hash = e.block_hash AND t.removed = e.removed
        GROUP BY pod_name, engine_name
    )
SELECT
    p.pod_name AS pod,
    p.engine_name AS engine,
    toUInt64(ev.n) AS kv_events,
    toUInt64(ev.stored) AS blocks_stored,
    toUInt64(ev.removed_events) AS block_removed_events,
    toUInt64(ev.removed) AS blocks_removed,
    toUInt64(x.evicted) AS evicted_blocks,
    toUInt64(ev.cleared) AS caches_cleared,
    toUInt64(r.n) AS restarts,
    toUInt64(x.reset) AS blocks_reset,
    CAST(if(x.evicted = 0 OR isNaN(x.mean_seconds), NULL, x.mean_seconds) AS Nullable(Float64)) AS mean_residency_seconds,
    toUInt64(x.unreused) AS removed_before_reuse
FROM pods AS p
LEFT JOIN events AS ev ON ev.pod_name = p.pod_name AND ev.engine_name = p.engine_name
LEFT JOIN restarts AS r ON r.pod_name = p.pod_name AND r.engine_name = p.engine_name
LEFT JOIN evictions AS x ON x.pod_name = p.pod_name AND x.engine_name = p.engine_name
ORDER BY pod, engine
