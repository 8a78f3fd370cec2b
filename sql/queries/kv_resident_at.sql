-- name: kv_resident_at
-- description: Per pod and engine, the KV-cache blocks resident at the time `until` by vLLM's KV events, and for a chain of block hashes (a prompt's blocks in order) how many of its leading blocks were resident there, and the block where that prefix stopped: when and why it had left.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | count only blocks stored from this time on (a block stored before the pod's first KV event counts as stored in 1970), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | the time T asked about: a block is resident at T when it was stored before T and had not left before T (an event at exactly T has not happened yet), UTC
-- param: pod: String = '' | pod to keep, '' = all
-- param: chain: Array(UInt64) = [] | block hashes in prompt order: vLLM's (as in BlockStored block_hashes) or kvscope chain hashes (kvscope/block_hash.py chain_hashes); [] = no chain
-- returns: pod String | pod name: every pod with KV events, and every pod with vLLM metrics in [since, until) (kv_events 0 for those without)
-- returns: engine String | vLLM data-parallel rank ('' when the pod publishes none, or sends no KV events)
-- returns: kv_events UInt64 | the pod and engine's KV events (BlockStored, BlockRemoved, AllBlocksCleared) before T; 0 = no KV events: nothing below is evidence
-- returns: first_event_ts Nullable(DateTime64(3, 'UTC')) | its first KV event, UTC: blocks stored before it are known only once they are removed
-- returns: resident_blocks UInt64 | distinct block hashes (per medium) resident at T, blocks
-- returns: resident_tokens UInt64 | Σ block_size of those blocks, tokens
-- returns: chain_blocks UInt64 | blocks in `chain`
-- returns: chain_resident_blocks UInt64 | leading blocks of `chain` resident at T: the prefix a request arriving at T could hit there, blocks
-- returns: stop_block_hash Nullable(UInt64) | the first block of `chain` not resident at T (NULL when the whole chain was, or it is empty)
-- returns: stop_removed_at Nullable(DateTime64(3, 'UTC')) | when that block last left this pod and engine before T, UTC (NULL: not resident here before T, as far as the events go)
-- returns: stop_removed_by Nullable(String) | how it left: block_removed (evicted), all_blocks_cleared (a prefix-cache reset) or pod_restart
--
-- Reads kv_block_residency (sql/migrations/0017: residency intervals from kv_block_log, one row per block of each
-- KV event; docs/kv-events.md). A chain hash matches a block by its vLLM hash or by its kvscope chain hash (equal
-- on pods with vLLM's default hashing). Leading blocks: counted from the chain's first block to the first one
-- not resident, as vLLM's prefix cache hits only a prefix. An event sent in pieces (cut between blocks to fit a
-- Kafka message, sql/migrations/0029) counts once in kv_events: by its piece with first_pos 0.
WITH
    pods AS
    (
        SELECT DISTINCT CAST(pod AS String) AS pod_name, CAST(engine AS String) AS engine_name
        FROM kv_block_events
        WHERE ts < {until:DateTime64(3, 'UTC')} AND ({pod:String} = '' OR pod = {pod:String})
        UNION DISTINCT
        SELECT DISTINCT CAST(pod AS String), ''
        FROM vllm_metrics
        WHERE name = 'vllm:num_requests_running' AND ts >= {since:DateTime64(3, 'UTC')}
          AND ts < {until:DateTime64(3, 'UTC')} AND ({pod:String} = '' OR pod = {pod:String})
          AND pod NOT IN (SELECT pod FROM kv_block_events WHERE ts < {until:DateTime64(3, 'UTC')})
    ),
    events AS
    (
        SELECT CAST(pod AS String) AS pod_name, CAST(engine AS String) AS engine_name, countIf(first_pos = 0) AS n,
               min(ts) AS first_ts
        FROM kv_block_events
        WHERE ts < {until:DateTime64(3, 'UTC')} AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY pod_name, engine_name
    ),
    intervals AS
    (
        SELECT CAST(pod AS String) AS pod_name, CAST(engine AS String) AS engine_name, block_size,
               arrayFilter(x -> x != 0, [block_hash, chain_hash]) AS names,
               ifNull(stored_at, toDateTime64(0, 3, 'UTC')) < {until:DateTime64(3, 'UTC')}
                   AND ifNull(stored_at, toDateTime64(0, 3, 'UTC')) >= {since:DateTime64(3, 'UTC')}
                   AND (removed_at IS NULL OR removed_at >= {until:DateTime64(3, 'UTC')}) AS resident,
               removed_at < {until:DateTime64(3, 'UTC')} AS left_before, removed_at, removed_by
        FROM kv_block_residency
        WHERE ({pod:String} = '' OR pod = {pod:String})
          AND ifNull(stored_at, toDateTime64(0, 3, 'UTC')) < {until:DateTime64(3, 'UTC')}
    ),
    resident AS
    (
        SELECT pod_name, engine_name, countIf(resident) AS blocks, sumIf(toUInt64(block_size), resident) AS tokens,
               groupUniqArrayArrayIf(arrayFilter(x -> has({chain:Array(UInt64)}, x), names), resident) AS hits,
               groupArrayIf((names, assumeNotNull(removed_at), ifNull(removed_by, '')),
                            left_before AND hasAny(names, {chain:Array(UInt64)})) AS departures
        FROM intervals
        GROUP BY pod_name, engine_name
    ),
    answer AS
    (
        SELECT p.pod_name AS pod_name, p.engine_name AS engine_name, e.n AS n, e.first_ts AS first_ts, r.blocks AS blocks,
               r.tokens AS tokens, length({chain:Array(UInt64)}) AS chain_len,
               arrayMap(h -> has(r.hits, h), {chain:Array(UInt64)}) AS flags,
               if(arrayAll(f -> f, flags), chain_len, arrayFirstIndex(f -> NOT f, flags) - 1) AS leading,
               if(leading < chain_len, {chain:Array(UInt64)}[leading + 1], NULL) AS stop,
               arrayReverseSort(d -> d.2, arrayFilter(d -> has(d.1, assumeNotNull(stop)), r.departures)) AS stop_departures
        FROM pods AS p
        LEFT JOIN events AS e ON e.pod_name = p.pod_name AND e.engine_name = p.engine_name
        LEFT JOIN resident AS r ON r.pod_name = p.pod_name AND r.engine_name = p.engine_name
    )
SELECT
    pod_name AS pod,
    engine_name AS engine,
    toUInt64(n) AS kv_events,
    CAST(if(n = 0, NULL, first_ts) AS Nullable(DateTime64(3, 'UTC'))) AS first_event_ts,
    toUInt64(blocks) AS resident_blocks,
    toUInt64(tokens) AS resident_tokens,
    toUInt64(chain_len) AS chain_blocks,
    toUInt64(leading) AS chain_resident_blocks,
    CAST(stop AS Nullable(UInt64)) AS stop_block_hash,
    CAST(if(empty(stop_departures), NULL, stop_departures[1].2) AS Nullable(DateTime64(3, 'UTC'))) AS stop_removed_at,
    CAST(if(empty(stop_departures), NULL, stop_departures[1].3) AS Nullable(String)) AS stop_removed_by
FROM answer
ORDER BY pod, engine
