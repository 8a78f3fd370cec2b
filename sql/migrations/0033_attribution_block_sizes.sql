-- attribution_block_sizes: the pods' block size change points (ingest/block_sizes.py) the attribution job last judged
-- with, saved whenever they differ from the last saved set. A later run that reads other change points (a late
-- vllm_cache_config row, or a late BlockStored of a new size, moved a pod's size at times already answered)
-- re-answers exactly the requests of that pod whose arrival falls where the two sets give different sizes. Each set
-- starts with a marker row (pod '') so that an empty set is told from none. A few rows per pod and size change.
CREATE TABLE IF NOT EXISTS attribution_block_sizes
(
    saved_at    DateTime64(3, 'UTC'),
    pod         String,
    since       Int64,
    block_size  Int64
)
ENGINE = MergeTree
ORDER BY (saved_at, pod, since);
