-- kv_event_gaps holds what each collector *reported*: the batches it did not receive live and how many it
-- replayed. Two reports overstate the loss, and only the store can tell (docs/kv-events.md, "Gaps"):
-- - a collector that stored batches and died before its checkpoint reports them again as a collector_restart
--   gap when it restarts (its checkpoint is older than what it stored): lost, though the store holds them;
-- - one gap reported again (after such a restart, or a replay) is a second record, whatever its outcome: a run
--   reported lost and later recovered read as a loss and a recovery.
-- The collector now reports the ts of the batch before the gap (prev_batch_ts) and of the batch that revealed it
-- (next_batch_ts): the missing batches of that publisher were stamped between the two, so the store's batches of
-- the gap's pod, engine and seqs stamped in (prev_batch_ts, next_batch_ts] are the ones not lost (a vLLM process
-- restarted in between numbers its batches from 0 again, later than prev_batch_ts; its predecessor's are older).
ALTER TABLE kv_event_gaps
    ADD COLUMN IF NOT EXISTS prev_batch_ts Nullable(DateTime64(3, 'UTC')) AFTER recovered,
    ADD COLUMN IF NOT EXISTS next_batch_ts Nullable(DateTime64(3, 'UTC')) AFTER prev_batch_ts;

-- kv_gaps: one row per gap. Reports of one stream (pod, engine) whose windows (prev_batch_ts, next_batch_ts]
-- and seq ranges overlap are one gap (a run reported again, or a longer run reported after a restart that
-- contains it), spanning the union of their seqs; its batches that the store holds in its window are stored, the
-- rest lost. A report without the two ts (from a collector older than this migration, or restored from a
-- checkpoint without a ts) is a gap of its own, with the collector's account: stored = replayed_batches.
-- Columns: gap_id (the event id of one of its reports), pod, engine, first_seq, last_seq (inclusive), batches
-- (last_seq - first_seq + 1: not received live), stored_batches (of them, held by kv_block_events), lost_batches
-- (batches - stored_batches), recovered (lost_batches = 0), reason (the first report's), reasons (all reports'),
-- reports, detected_at (the first report's), last_detected_at, replayed_batches (the most one report replayed),
-- resumed_ts and resumed_seq (the first batch of the gap's window stored: the gap's first stored batch, or the one
-- that revealed it; NULL when unknown).
-- A batch whose every event was a dead letter adds no row to kv_block_events (docs/kv-events.md, "Bad events"):
-- its seq reads as lost here, as its events are missing from the evidence.
-- How it reads (each a pitfall met on the way):
-- - reports of one stream whose windows overlap or touch are one time cluster, and within it reports whose seqs
--   overlap are one gap (windows and seqs each merged as intervals): reports 2..3, 5..6 and 1..10 with overlapping
--   windows are one gap 1..10, seqs 2..3 never lost twice;
-- - the window is [prev_batch_ts, next_batch_ts]: vLLM stamps batches in ms, and batches of one ms (the one before
--   the gap, those in it and the one after) must fall inside it. The batch before the gap is not counted: its seq
--   is first_seq - 1;
-- - reports without both ts are filtered in subqueries of their own: ClickHouse resolves a name in WHERE to the
--   SELECT's alias first, so `WHERE lo IS NOT NULL` beside `assumeNotNull(lo) AS lo` would test the alias.
CREATE OR REPLACE VIEW kv_gaps AS
WITH
    reports AS
    (
        SELECT event_id, CAST(any(pod) AS String) AS pod, CAST(any(engine) AS String) AS engine,
               any(detected_at) AS detected_at, any(first_seq) AS first_seq, any(last_seq) AS last_seq,
               CAST(any(reason) AS String) AS reason, any(replayed_batches) AS replayed_batches,
               any(prev_batch_ts) AS lo, any(next_batch_ts) AS hi
        FROM kv_event_gaps
        GROUP BY event_id
    ),
    -- reports of one stream whose windows overlap or touch (transitively) are one time cluster t; within it,
    -- reports whose seq ranges overlap (transitively) are one gap n. Gaps of one cluster hold disjoint seqs, gaps of
    -- two clusters disjoint windows: no stored batch is counted by two gaps, no seq lost twice in one window.
    grouped AS
    (
        SELECT *, sum(new_s) OVER (PARTITION BY pod, engine, t ORDER BY first_seq, last_seq, event_id
                                   ROWS UNBOUNDED PRECEDING) AS n
        FROM
        (
            SELECT *, toUInt8(isNull(prev_last) OR first_seq > assumeNotNull(prev_last)) AS new_s
            FROM
            (
                SELECT *, max(toNullable(last_seq)) OVER (PARTITION BY pod, engine, t ORDER BY first_seq, last_seq,
                          event_id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_last
                FROM
                (
                    SELECT *, sum(new_t) OVER (PARTITION BY pod, engine ORDER BY lo, hi, event_id
                                               ROWS UNBOUNDED PRECEDING) AS t
                    FROM
                    (
                        SELECT *, toUInt8(isNull(prev_hi) OR lo > assumeNotNull(prev_hi)) AS new_t
                        FROM
                        (
                            SELECT event_id, pod, engine, detected_at, first_seq, last_seq, reason, replayed_batches,
                                   lo, hi,
                                   max(toNullable(hi)) OVER (PARTITION BY pod, engine ORDER BY lo, hi, event_id
                                       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_hi
                            FROM
                            (
                                SELECT event_id, pod, engine, detected_at, first_seq, last_seq, reason,
                                       replayed_batches, assumeNotNull(lo) AS lo, assumeNotNull(hi) AS hi
                                FROM (SELECT * FROM reports WHERE lo IS NOT NULL AND hi IS NOT NULL)
                            )
                        )
                    )
                )
            )
        )
    ),
    gaps AS
    (
        SELECT min(e) AS gap_id, pod, engine, min(f) AS first_seq, max(l) AS last_seq, argMin(r, (d, e)) AS reason,
               arraySort(groupUniqArray(r)) AS reasons, count() AS reports, min(d) AS detected_at,
               max(d) AS last_detected_at, max(k) AS replayed_batches, toNullable(min(a)) AS lo,
               toNullable(max(b)) AS hi
        FROM (SELECT event_id AS e, pod, engine, t, n, first_seq AS f, last_seq AS l, reason AS r, detected_at AS d,
                     replayed_batches AS k, lo AS a, hi AS b FROM grouped)
        GROUP BY pod, engine, t, n
        UNION ALL
        SELECT event_id, pod, engine, first_seq, last_seq, reason, [reason], toUInt64(1), detected_at, detected_at,
               replayed_batches, CAST(NULL AS Nullable(DateTime64(3, 'UTC'))),
               CAST(NULL AS Nullable(DateTime64(3, 'UTC')))
        FROM reports
        WHERE lo IS NULL OR hi IS NULL
    ),
    stored AS
    (
        -- a gap of at most 100,000 batches (every real outage of minutes to hours): its seqs listed and matched
        -- with the store's by key; a longer one (a seq that jumped by billions: a bug, or hostile input) is
        -- matched by range instead, against its stream's batches in its window, never listed
        SELECT gap_id, uniqExactIf(seq, seq <= last_seq) AS stored_batches,
               toNullable(argMin(ts, (seq, ts))) AS resumed_ts, toNullable(min(seq)) AS resumed_seq
        FROM
        (
            SELECT g.gap_id AS gap_id, g.last_seq AS last_seq, b.seq AS seq, b.ts AS ts
            FROM
            (
                SELECT gap_id, pod, engine, last_seq, assumeNotNull(lo) AS lo, assumeNotNull(hi) AS hi,
                       arrayJoin(range(first_seq, last_seq + 2)) AS seq
                FROM (SELECT * FROM gaps WHERE lo IS NOT NULL AND last_seq - first_seq < 100000)
            ) AS g
            INNER JOIN
            (
                SELECT DISTINCT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, seq, ts
                FROM kv_block_events
                WHERE (pod, engine) IN (SELECT pod, engine FROM gaps WHERE lo IS NOT NULL)
                  AND ts >= (SELECT min(lo) FROM gaps) AND ts <= (SELECT max(hi) FROM gaps)
                  AND (CAST(pod AS String), CAST(engine AS String), seq) IN
                      (SELECT pod, engine, arrayJoin(range(first_seq, last_seq + 2)) FROM gaps
                       WHERE lo IS NOT NULL AND last_seq - first_seq < 100000)
            ) AS b ON b.pod = g.pod AND b.engine = g.engine AND b.seq = g.seq
            WHERE b.ts >= g.lo AND b.ts <= g.hi
            UNION ALL
            SELECT g.gap_id, g.last_seq, b.seq, b.ts
            FROM
            (
                SELECT gap_id, pod, engine, first_seq, last_seq, assumeNotNull(lo) AS lo, assumeNotNull(hi) AS hi
                FROM (SELECT * FROM gaps WHERE lo IS NOT NULL AND last_seq - first_seq >= 100000)
            ) AS g
            INNER JOIN
            (
                SELECT DISTINCT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, seq, ts
                FROM kv_block_events
                WHERE (pod, engine) IN (SELECT pod, engine FROM gaps
                                        WHERE lo IS NOT NULL AND last_seq - first_seq >= 100000)
                  AND ts >= (SELECT min(lo) FROM gaps WHERE lo IS NOT NULL AND last_seq - first_seq >= 100000)
                  AND ts <= (SELECT max(hi) FROM gaps WHERE lo IS NOT NULL AND last_seq - first_seq >= 100000)
            ) AS b ON b.pod = g.pod AND b.engine = g.engine
            WHERE b.seq >= g.first_seq AND b.seq <= g.last_seq + 1 AND b.ts >= g.lo AND b.ts <= g.hi
        )
        GROUP BY gap_id
    )
SELECT g.gap_id AS gap_id, g.pod AS pod, g.engine AS engine, g.first_seq AS first_seq, g.last_seq AS last_seq,
       g.last_seq - g.first_seq + 1 AS batches,
       toUInt64(if(g.lo IS NULL, least(g.replayed_batches, batches), ifNull(s.stored_batches, 0))) AS stored_batches,
       batches - stored_batches AS lost_batches, lost_batches = 0 AS recovered,
       g.reason AS reason, g.reasons AS reasons, g.reports AS reports, g.detected_at AS detected_at,
       g.last_detected_at AS last_detected_at, g.replayed_batches AS replayed_batches,
       if(g.lo IS NULL, NULL, s.resumed_ts) AS resumed_ts, if(g.lo IS NULL, NULL, s.resumed_seq) AS resumed_seq
FROM gaps AS g
LEFT JOIN stored AS s ON s.gap_id = g.gap_id;

-- kv_cache_resets (sql/migrations/0017, 0022): a vLLM restart whose first batches were lost is marked at the
-- first batch stored from the new process, read from kv_gaps: after a publisher_restart gap whose batches were
-- all stored (the seq-0 batch among them marks it already) nothing more, where 0022 marked a restart at the batch
-- that revealed the gap, ending every block of the new process stored before it. Reports without the batch ts
-- keep 0022's reading.
CREATE OR REPLACE VIEW kv_cache_resets AS
SELECT DISTINCT pod, engine, ts, seq, idx, kind
FROM
(
    SELECT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, ts, seq, idx, CAST(kind AS String) AS kind
    FROM kv_block_log
    WHERE kind IN ('cleared', 'restart')
    UNION ALL
    SELECT pod, engine, assumeNotNull(resumed_ts), assumeNotNull(resumed_seq), toUInt32(0), 'restart'
    FROM kv_gaps
    WHERE has(reasons, 'publisher_restart') AND lost_batches > 0 AND resumed_seq IS NOT NULL
    UNION ALL
    SELECT g.pod, g.engine, o.1, o.2, toUInt32(0), 'restart'
    FROM
    (
        SELECT g.pod AS pod, g.engine AS engine, argMax((b.ts, b.seq), b.ts) AS o
        FROM (SELECT event_id, CAST(any(pod) AS String) AS pod, CAST(any(engine) AS String) AS engine,
                     any(last_seq) + 1 - any(replayed_batches) AS first_new_seq, any(detected_at) AS detected_at
              FROM kv_event_gaps
              WHERE reason = 'publisher_restart' AND NOT recovered AND (prev_batch_ts IS NULL OR next_batch_ts IS NULL)
              GROUP BY event_id) AS g
        INNER JOIN (SELECT DISTINCT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, ts, seq
                    FROM kv_block_log
                    WHERE seq IN (SELECT any(last_seq) + 1 - any(replayed_batches) FROM kv_event_gaps
                                  WHERE reason = 'publisher_restart' AND NOT recovered
                                    AND (prev_batch_ts IS NULL OR next_batch_ts IS NULL)
                                  GROUP BY event_id)
                   ) AS b ON b.pod = g.pod AND b.engine = g.engine AND b.seq = g.first_new_seq
        WHERE b.ts >= g.detected_at - INTERVAL 1 HOUR AND b.ts <= g.detected_at + INTERVAL 1 MINUTE
        GROUP BY g.event_id, g.pod, g.engine
    ) AS g
);
