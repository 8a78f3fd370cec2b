-- A vLLM KV-event batch too large for one Kafka message is sent in parts (collector/kv_split.py,
-- docs/kv-events.md "A batch larger than a Kafka message"): cut between events, and an event with too many blocks
-- cut between blocks. Each part's rows must give kv_block_log the rows the whole batch would have given.
--
-- first_pos: where the row's first block was in vLLM's event (0 unless the event was cut between blocks), so a
-- block's pos in kv_block_log is first_pos + its place in the row. It joins the sorting key: the pieces of one
-- event share (pod, engine, ts, seq, idx) and must not collapse into one on merge. ClickHouse extends a sorting
-- key only with a column added in the same ALTER, with no default expression (0 is UInt32's own default).
-- continued: 1 for every part of a split batch but its first; the first alone marks a vLLM start (seq 0), so
-- the restart row is made once per batch and with the medium of its first event, whichever inserts the parts
-- land in.
-- if: SELECT count() = 0 FROM system.columns WHERE database = currentDatabase() AND table = 'kv_block_events' AND name = 'first_pos'
ALTER TABLE kv_block_events
    ADD COLUMN IF NOT EXISTS first_pos UInt32 AFTER chain_hashes,
    ADD COLUMN IF NOT EXISTS continued UInt8 AFTER first_pos,
    MODIFY ORDER BY (pod, engine, ts, seq, idx, first_pos);

-- The views that fill kv_block_log from kv_block_events (sql/migrations/0017, 0025) read the new columns. Each new
-- view is created before the old one is dropped: in between, a row written by both is the same row (first_pos
-- and continued are 0 on every row written before), which kv_block_log (ReplacingMergeTree) collapses.
CREATE MATERIALIZED VIEW IF NOT EXISTS kv_block_log_pieces_mv TO kv_block_log AS
SELECT pod, engine, medium, h AS block_hash, ts, seq, idx, toUInt32(first_pos + n - 1) AS pos,
       if(event_type = 'BlockStored', 'stored', 'removed') AS kind,
       if(event_type = 'BlockStored', if(n = 1, parent_block_hash, block_hashes[n - 1]), NULL) AS parent_block_hash,
       if(length(chain_hashes) = length(block_hashes), chain_hashes[n], 0) AS chain_hash,
       block_size
FROM kv_block_events
ARRAY JOIN block_hashes AS h, arrayEnumerate(block_hashes) AS n
WHERE event_type IN ('BlockStored', 'BlockRemoved');

DROP VIEW IF EXISTS kv_block_log_blocks_mv;

-- The inner GROUP BY runs on each insert block (a materialized view sees one insert at a time).
CREATE MATERIALIZED VIEW IF NOT EXISTS kv_block_log_starts_mv TO kv_block_log AS
SELECT pod, engine, medium, toUInt64(0) AS block_hash, ts, toUInt64(0) AS seq, toUInt32(0) AS idx,
       toUInt32(0) AS pos, 'restart' AS kind, CAST(NULL AS Nullable(UInt64)) AS parent_block_hash,
       toUInt64(0) AS chain_hash, toUInt32(0) AS block_size
FROM
(
    SELECT pod, engine, ts, argMin(medium, idx) AS medium
    FROM kv_block_events
    WHERE seq = 0 AND continued = 0
    GROUP BY pod, engine, ts
);

DROP VIEW IF EXISTS kv_block_log_restarts_mv;
