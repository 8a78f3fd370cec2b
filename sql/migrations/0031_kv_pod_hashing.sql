-- kv_pod_hashing: per pod, whether it ever published a stored block under a hash other than kvscope's chain hash
-- of its tokens (own_hashing = 1: vLLM hashing with another algorithm or seed than the one kvscope reproduces,
-- docs/kv-events.md "The chain hash of a block"; 0: vLLM's default hashing, the two hashes equal). Precise mode reads each
-- chunk's missed blocks from kv_block_log by vLLM hash; only a pod hashing its own way needs its stored rows
-- looked up by chain hash as well (ingest/kv_evidence.py fetch_blocks). Knowing which pods do lets that second
-- lookup read only their rows, instead of the chain_hash and kind columns of the whole log for every chunk.
-- A pod is counted from its first BlockStored event whose chain hashes were computed (as kv_block_log's
-- chain_hash: only when there is one per block).
CREATE TABLE IF NOT EXISTS kv_pod_hashing
(
    pod          LowCardinality(String),
    own_hashing  SimpleAggregateFunction(max, UInt8)
)
ENGINE = AggregatingMergeTree
ORDER BY pod;

CREATE MATERIALIZED VIEW IF NOT EXISTS kv_pod_hashing_mv TO kv_pod_hashing AS
SELECT pod, max(toUInt8(arrayExists((c, b) -> c != 0 AND c != b, chain_hashes, block_hashes))) AS own_hashing
FROM kv_block_events
WHERE event_type = 'BlockStored' AND length(chain_hashes) = length(block_hashes)
GROUP BY pod;

-- The pods of events stored before this migration, once.
-- if: SELECT (SELECT count() FROM kv_pod_hashing) = 0 AND (SELECT count() FROM kv_block_events) > 0
INSERT INTO kv_pod_hashing
SELECT pod, max(toUInt8(arrayExists((c, b) -> c != 0 AND c != b, chain_hashes, block_hashes))) AS own_hashing
FROM kv_block_events
WHERE event_type = 'BlockStored' AND length(chain_hashes) = length(block_hashes)
GROUP BY pod;
