-- kv_cache_resets (sql/migrations/0017) read only what it needs: the attribution job reads it once per chunk of
-- 10^5 requests, and at 10^6 requests of KV history each read cost ~40 CPU seconds while returning nothing.
-- Same rows as before: the outer DISTINCT already drops a row written twice, so the first branch needs no
-- FINAL (it reads the `kind` column, not a merge of the whole log); the second branch reads the log's batches
-- only at the (pod, engine, seq) that an unrecovered publisher_restart gap names, instead of building the
-- DISTINCT of every (pod, engine, ts, seq) of the log for a join that, without such gaps, matches nothing.
CREATE OR REPLACE VIEW kv_cache_resets AS
SELECT DISTINCT pod, engine, ts, seq, idx, kind
FROM
(
    SELECT CAST(pod AS String) AS pod, CAST(engine AS String) AS engine, ts, seq, idx, CAST(kind AS String) AS kind
    FROM kv_block_log
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
                    FROM kv_block_log
                    WHERE seq IN (SELECT any(last_seq) + 1 - any(replayed_batches) FROM kv_event_gaps
                                  WHERE reason = 'publisher_restart' AND NOT recovered GROUP BY event_id)
                   ) AS b ON b.pod = g.pod AND b.engine = g.engine AND b.seq = g.first_new_seq
        WHERE b.ts >= g.detected_at - INTERVAL 1 HOUR AND b.ts <= g.detected_at + INTERVAL 1 MINUTE
        GROUP BY g.event_id, g.pod, g.engine
    ) AS g
);
