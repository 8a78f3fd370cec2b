-- attribution_gap_restarts: the vLLM restarts that publisher_restart gap reports add to kv_cache_resets
-- (sql/migrations/0030: kv_gaps' resumed batch, or 0022's reading for reports without batch times) as the
-- attribution job last judged with, saved whenever they differ from the last saved set. A gap report travels on its
-- own Kafka topic and can reach the store after the job answered the requests behind the restart, without any late
-- kv_block_events row; a replayed batch can also move or remove such a restart. A later run that reads another set
-- re-answers exactly the requests each added or removed restart can change (ingest/attribution_late.py
-- reset_targets). Each set starts with a marker row (pod '') so that an empty set is told from none. ts: unix ms.
CREATE TABLE IF NOT EXISTS attribution_gap_restarts
(
    saved_at  DateTime64(3, 'UTC'),
    pod       String,
    engine    String,
    ts        Int64,
    seq       UInt64
)
ENGINE = MergeTree
ORDER BY (saved_at, pod, engine, ts);
