-- Block-level evidence (docs/kv-events.md): which KV blocks each pod held, and when and why each left.
--
-- kv_block_events gains chain_hashes: kvscope's chain hash of each stored block (kvscope/block_hash.py),
-- parallel to block_hashes, 0 = unknown; [] for rows written before this migration or by an older collector.
ALTER TABLE kv_block_events ADD COLUMN IF NOT EXISTS chain_hashes Array(UInt64) AFTER medium;

-- kv_block_log: one row per block of each BlockStored/BlockRemoved event (kind stored/removed), one per
-- AllBlocksCleared (kind cleared) and one per vLLM start (kind restart: a publisher's first batch, seq 0),
-- ordered within a pod and engine by (ts, seq, idx, pos). parent_block_hash of a stored block: the previous
-- block of the same event, or the event's parent for its first block.
-- ReplacingMergeTree over the full identity: a row written twice collapses (readers use FINAL).
CREATE TABLE IF NOT EXISTS kv_block_log
(
    pod                LowCardinality(String),
    engine             LowCardinality(String),
    medium             LowCardinality(String),
    block_hash         UInt64,
    ts                 DateTime64(3, 'UTC'),
    seq                UInt64,
    idx                UInt32,
    pos                UInt32,
    kind               LowCardinality(String),
    parent_block_hash  Nullable(UInt64),
    chain_hash         UInt64,
    block_size         UInt32
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(ts)
ORDER BY (pod, engine, medium, block_hash, ts, seq, idx, pos, kind);

-- Fed by materialized views, not by the ingester: the ingester already writes each event to kv_block_events
-- exactly once (dedup by event_id before the insert), so a view sees each once, and pairing a removal or clear
-- with its store happens at read time by event order (kv_block_residency), so nothing depends on the order
-- batches arrive in (a replayed batch lands after newer ones) and no ingester state can be lost or redone.
CREATE MATERIALIZED VIEW IF NOT EXISTS kv_block_log_blocks_mv TO kv_block_log AS
SELECT pod, engine, medium, h AS block_hash, ts, seq, idx, toUInt32(n - 1) AS pos,
       if(event_type = 'BlockStored', 'stored', 'removed') AS kind,
       if(event_type = 'BlockStored', if(n = 1, parent_block_hash, block_hashes[n - 1]), NULL) AS parent_block_hash,
       if(length(chain_hashes) = length(block_hashes), chain_hashes[n], 0) AS chain_hash,
       block_size
FROM kv_block_events
ARRAY JOIN block_hashes AS h, arrayEnumerate(block_hashes) AS n
WHERE event_type IN ('BlockStored', 'BlockRemoved');

CREATE MATERIALIZED VIEW IF NOT EXISTS kv_block_log_resets_mv TO kv_block_log AS
SELECT pod, engine, medium, toUInt64(0) AS block_hash, ts, seq, idx, toUInt32(0) AS pos,
       reset AS kind,
       CAST(NULL AS Nullable(UInt64)) AS parent_block_hash, toUInt64(0) AS chain_hash, toUInt32(0) AS block_size
FROM kv_block_events
ARRAY JOIN arrayFilter(x -> x != '', [if(event_type = 'AllBlocksCleared', 'cleared', ''),
                                     if(seq = 0 AND idx = 0, 'restart', '')]) AS reset
WHERE event_type = 'AllBlocksCleared' OR (seq = 0 AND idx = 0);

-- Events stored before this migration, once (the log is empty only before its first fill).
-- if: SELECT (SELECT count() FROM kv_block_log) = 0 AND (SELECT count() FROM kv_block_events) > 0
INSERT INTO kv_block_log
SELECT pod, engine, medium, h AS block_hash, ts, seq, idx, toUInt32(n - 1) AS pos,
       if(event_type = 'BlockStored', 'stored', 'removed') AS kind,
       if(event_type = 'BlockStored', if(n = 1, parent_block_hash, block_hashes[n - 1]), NULL) AS parent_block_hash,
       if(length(chain_hashes) = length(block_hashes), chain_hashes[n], 0) AS chain_hash,
       block_size
FROM kv_block_events FINAL
ARRAY JOIN block_hashes AS h, arrayEnumerate(block_hashes) AS n
WHERE event_type IN ('BlockStored', 'BlockRemoved')
UNION ALL
SELECT pod, engine, medium, toUInt64(0), ts, seq, idx, toUInt32(0),
       reset,
       CAST(NULL AS Nullable(UInt64)), toUInt64(0), toUInt32(0)
FROM kv_block_events FINAL
ARRAY JOIN arrayFilter(x -> x != '', [if(event_type = 'AllBlocksCleared', 'cleared', ''),
                                     if(seq = 0 AND idx = 0, 'restart', '')]) AS reset
WHERE event_type = 'AllBlocksCleared' OR (seq = 0 AND idx = 0);

-- kv_cache_resets: every event that emptied a pod's (engine's) prefix cache: an AllBlocksCleared (kind cleared;
-- vLLM's reset_prefix_cache) or a vLLM start (kind restart): a publisher's first batch (seq 0), or, when that
-- batch was lost (an unrecovered publisher_restart gap, sql/migrations/0010), the first batch received from the
-- new process: vLLM replays the newest batches it still holds, so that is seq last_seq + 1 − replayed_batches
-- (the latest batch of that seq up to a minute after the gap was detected, and at most an hour before it).
CREATE VIEW IF NOT EXISTS kv_cache_resets AS
SELECT DISTINCT pod, engine, ts, seq, idx, kind
FROM
(
    SELECT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, ts, seq, idx, CAST(kind AS String) AS kind
    FROM kv_block_log FINAL
    WHERE kind IN ('cleared', 'restart')
    UNION ALL
    SELECT g.pod, g.engine, o.1, o.2, toUInt32(0), 'restart'
    FROM
    (
        SELECT g.pod AS pod, g.engine AS engine, argMax((b.ts, b.seq), b.ts) AS o
        FROM (SELECT event_id, CAST(any(pod) AS String) AS pod, CAST(any(engine) AS String) AS engine,
                     any(last_seq) + 1 - any(replayed_batches) AS first_new_seq, any(detected_at) AS detected_at
              FROM kv_event_gaps WHERE reason = 'publisher_restart' AND NOT recovered GROUP BY event_id) AS g
        INNER JOIN (SELECT DISTINCT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, ts, seq
                    FROM kv_block_log) AS b ON b.pod = g.pod AND b.engine = g.engine AND b.seq = g.first_new_seq
        WHERE b.ts >= g.detected_at - INTERVAL 1 HOUR AND b.ts <= g.detected_at + INTERVAL 1 MINUTE
        GROUP BY g.event_id, g.pod, g.engine
    ) AS g
);

-- kv_block_residency: one row per residency interval of a block hash on a pod, engine and medium: from the store
-- that gave it its first copy (stored_at; NULL = stored before the evidence begins, or in a batch never
-- received) to the event that left it no copy (removed_at, removed_by; NULL = still resident).
-- vLLM does not deduplicate blocks (vllm/v1/core/block_pool.py, BlockHashToBlockMap): two requests can store
-- the same hash twice, each copy removed on its own, so a hash is resident while its copies (stores − removals
-- since the last reset) are above 0. A cache reset (kv_cache_resets: an AllBlocksCleared or a vLLM restart) ends
-- every interval of the pod and engine. A removal with no copy to remove is counted as a copy stored before the evidence (or its reset) began.
CREATE VIEW IF NOT EXISTS kv_block_residency AS
WITH
    resets AS
    (
        SELECT pod, engine, arraySort(groupArray((ts, seq, idx, toUInt32(0), toUInt8(kind = 'cleared')))) AS orders
        FROM kv_cache_resets
        GROUP BY pod, engine
    ),
    blocks AS
    (
        SELECT l.pod AS pod, l.engine AS engine, l.medium AS medium, l.block_hash AS block_hash, l.ts AS ts,
               l.kind AS kind, l.parent_block_hash AS parent_block_hash, l.chain_hash AS chain_hash,
               l.block_size AS block_size, (l.ts, l.seq, l.idx, l.pos, toUInt8(1)) AS o,
               if(l.kind = 'stored', 1, -1) AS delta, r.orders AS orders, arrayCount(x -> x < o, r.orders) AS segment
        FROM kv_block_log AS l FINAL
        LEFT JOIN resets AS r ON r.pod = l.pod AND r.engine = l.engine
        WHERE l.kind IN ('stored', 'removed')
    ),
    running AS
    (
        SELECT *, sum(delta) OVER (PARTITION BY pod, engine, medium, block_hash, segment ORDER BY o
                                   ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS run
        FROM blocks
    ),
    counted AS
    (
        SELECT *, greatest(0, -min(run) OVER (PARTITION BY pod, engine, medium, block_hash, segment)) AS unseen,
               unseen + run AS copies, delta = 1 AND copies = 1 AS starts, delta = -1 AND copies = 0 AS ends
        FROM running
    ),
    numbered AS
    (
        SELECT *, toUInt64(unseen > 0) + sum(toUInt64(starts)) OVER (PARTITION BY pod, engine, medium, block_hash,
                  segment ORDER BY o ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS interval_no
        FROM counted
    ),
    intervals AS
    (
        SELECT pod, engine, medium, block_hash, segment, interval_no,
               argMinIf(chain_hash, o, kind = 'stored') AS chain_hash,
               argMinIf(parent_block_hash, o, kind = 'stored') AS parent_block_hash,
               argMinIf(block_size, o, kind = 'stored') AS block_size,
               interval_no = 1 AND max(unseen) > 0 AS stored_unseen, minIf(ts, starts) AS first_store,
               countIf(ends) > 0 AS removed_here, maxIf(ts, ends) AS last_removal, any(orders) AS reset_orders,
               countIf(kind = 'stored') AS stores, countIf(kind = 'removed') AS removals
        FROM numbered
        GROUP BY pod, engine, medium, block_hash, segment, interval_no
    )
SELECT
    pod, engine, medium, block_hash, chain_hash, parent_block_hash, block_size,
    CAST(if(stored_unseen, NULL, first_store) AS Nullable(DateTime64(3, 'UTC'))) AS stored_at,
    CAST(if(removed_here, last_removal, if(segment < length(reset_orders), reset_orders[segment + 1].1, NULL))
         AS Nullable(DateTime64(3, 'UTC'))) AS removed_at,
    CAST(if(removed_here, 'block_removed',
            if(segment < length(reset_orders),
               if(reset_orders[segment + 1].5 = 1, 'all_blocks_cleared', 'pod_restart'), NULL))
         AS Nullable(String)) AS removed_by,
    stores, removals
FROM intervals;
