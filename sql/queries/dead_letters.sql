-- name: dead_letters
-- description: Input the pipeline could not use, counted by source and reason, with the latest example of each (pipeline health: nothing is dropped silently).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: pod: String = '' | pod the input came from, '' = all
-- param: limit: UInt32 = 100 | at most this many (source, reason) rows
-- returns: source String | vllm_metrics, gateway_log, kv_events, ingest or workload_labels
-- returns: reason String | why it was rejected (one sentence)
-- returns: occurrences UInt64 | rows in dead_letters (every occurrence, re-sends included)
-- returns: distinct_events UInt64 | distinct event_id (re-sends of the same input counted once)
-- returns: first_ts DateTime64(3, 'UTC') | first occurrence, UTC
-- returns: last_ts DateTime64(3, 'UTC') | latest occurrence, UTC
-- returns: latest_pod String | pod of the latest occurrence ('' if none)
-- returns: latest_location String | where the latest one was read (file:offset, URL, topic:seq)
-- returns: latest_raw String | the latest offending input, first 500 characters
SELECT
    CAST(source AS String) AS source,
    reason,
    count() AS occurrences,
    uniqExact(event_id) AS distinct_events,
    min(ts) AS first_ts,
    max(ts) AS last_ts,
    CAST(argMax(pod, ts) AS String) AS latest_pod,
    argMax(location, ts) AS latest_location,
    substringUTF8(argMax(raw, ts), 1, 500) AS latest_raw
FROM dead_letters
WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
  AND ({pod:String} = '' OR pod = {pod:String})
GROUP BY source, reason
ORDER BY last_ts DESC, source, reason
LIMIT {limit:UInt32}
