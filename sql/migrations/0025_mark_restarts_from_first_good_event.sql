-- A vLLM start (kv_cache_resets kind restart, sql/migrations/0017) is marked from the first event of a
-- publisher's first batch (seq 0) that was stored, not only from its event 0: when event 0 was malformed (a
-- dead letter of its own, the batch keeping its other events at their index), the restart went unmarked and the
-- blocks of the previous process stayed resident in kv_block_residency.
-- The restart row is one per batch whatever events of it arrive, and in whichever inserts: its identity is the
-- batch's (pod, engine, ts, seq 0) with idx 0 and pos 0 (before every event of the batch, as before), so a second
-- insert of the same batch (the ingester halving a batch on a permanent error, a redelivery of events not yet
-- stored) writes the same row again, which kv_block_log (ReplacingMergeTree) collapses and kv_cache_resets
-- (DISTINCT) reads once. medium: the first stored event's (a restart empties every medium).
-- The clears keep their own view, as kv_block_log_resets_mv wrote them; that view is dropped once both new ones
-- exist (between the two, a row written by both is the same row).
CREATE MATERIALIZED VIEW IF NOT EXISTS kv_block_log_clears_mv TO kv_block_log AS
SELECT pod, engine, medium, toUInt64(0) AS block_hash, ts, seq, idx, toUInt32(0) AS pos, 'cleared' AS kind,
       CAST(NULL AS Nullable(UInt64)) AS parent_block_hash, toUInt64(0) AS chain_hash, toUInt32(0) AS block_size
FROM kv_block_events
WHERE event_type = 'AllBlocksCleared';

-- The inner GROUP BY runs on each insert block (a materialized view sees one insert at a time).
CREATE MATERIALIZED VIEW IF NOT EXISTS kv_block_log_restarts_mv TO kv_block_log AS
SELECT pod, engine, medium, toUInt64(0) AS block_hash, ts, toUInt64(0) AS seq, toUInt32(0) AS idx,
       toUInt32(0) AS pos, 'restart' AS kind, CAST(NULL AS Nullable(UInt64)) AS parent_block_hash,
       toUInt64(0) AS chain_hash, toUInt32(0) AS block_size
FROM
(
    SELECT pod, engine, ts, argMin(medium, idx) AS medium
    FROM kv_block_events
    WHERE seq = 0
    GROUP BY pod, engine, ts
);

DROP VIEW IF EXISTS kv_block_log_resets_mv;

-- Seq-0 batches stored before this migration without a restart row (their event 0 was a dead letter): their
-- restart, once (a batch that has one is skipped, so running this again adds nothing).
INSERT INTO kv_block_log
SELECT pod, engine, medium, toUInt64(0), ts, toUInt64(0), toUInt32(0), toUInt32(0), 'restart',
       CAST(NULL AS Nullable(UInt64)), toUInt64(0), toUInt32(0)
FROM
(
    SELECT pod, engine, ts, argMin(medium, idx) AS medium
    FROM kv_block_events
    WHERE seq = 0
    GROUP BY pod, engine, ts
)
WHERE (pod, engine, ts) NOT IN (SELECT pod, engine, ts FROM kv_block_log WHERE kind = 'restart' AND seq = 0);
