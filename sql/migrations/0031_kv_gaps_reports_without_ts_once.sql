-- kv_gaps (sql/migrations/0030), three readings fixed:
-- - every report without both batch ts (an older collector's, or one restored from a checkpoint without a ts) was
--   read twice: once as a gap of its own, as meant, and once more among the reports with a window, as a window
--   from 1970. ClickHouse resolves a name in WHERE to the SELECT's alias first, so `WHERE lo IS NOT NULL` beside
--   `assumeNotNull(lo) AS lo` tested the alias, always true; each such filter now has a subquery of its own;
-- - reports of one stream were merged in one pass ordered by window start, a new gap at any report whose seqs
--   started past every earlier one's: reports 2..3, 5..6 and 1..10 with overlapping windows read as two gaps,
--   1..10 and 2..3, seqs 2..3 lost twice. Now reports whose windows overlap or touch are one time cluster, and
--   within it reports whose seqs overlap are one gap (windows and seqs each merged as intervals);
-- - the window is [prev_batch_ts, next_batch_ts], not (prev_batch_ts, next_batch_ts]: vLLM stamps batches in ms,
--   and batches of one ms (the one before the gap, those in it and the one after) left a stored batch outside
--   an empty window, read as lost. The batch before the gap is not counted: its seq is first_seq - 1.
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
