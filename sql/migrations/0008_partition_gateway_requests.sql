-- gateway_requests, laid out for exact counts at fleet scale (docs/reliability.md, docs/decisions.md):
-- * MergeTree, not ReplacingMergeTree: the ingester writes each request exactly once (it drops rows whose
--   (request_id, ts) the table already holds before it inserts), so readers need no FINAL and the
--   materialized views fed from this table (request_keys below) count every request once.
-- * PARTITION BY day: retention drops whole days (TTL) and time-bounded reads skip other days.
-- * ORDER BY (tenant_id, ts, request_id): drill-downs filter by tenant and time; request_id last makes
--   the key unique per request.
-- * ingested_at (the server's clock, one clock for every writer) with a minmax index: the attribution job
--   picks up what arrived since its watermark without scanning every part; order_key has one too (the job
--   reads its chunks by order_key range).
-- * predecessor_keys / order_key (MATERIALIZED: computed once, at insert, from the row itself): the keys on
--   which a later request may find this one as its predecessor, and a unique arrival order (ts in ms, then
--   20 bits of MD5(request_id) to order requests of the same millisecond). Kinds: 1 conversation,
--   2 agent run, 3 prompt fingerprint (any tenant), 4 normalized system prompt, 5 canonical tools,
--   6 retrieval set; the same rules as ingest/attribution.py predecessor_keys().

-- Once: move the 0.1 table (ReplacingMergeTree keyed by event_id, no partitions) out of the way; its rows are
-- copied in 0013, once every table and rollup that is fed from gateway_requests exists.
-- if: SELECT count() FROM system.tables WHERE database = currentDatabase() AND name = 'gateway_requests' AND engine = 'ReplacingMergeTree'
RENAME TABLE gateway_requests TO gateway_requests_v1;

CREATE TABLE IF NOT EXISTS gateway_requests
(
    request_id            String,
    ts                    DateTime64(3, 'UTC'),
    tenant_id             LowCardinality(String),
    conversation_id       String,
    agent_run_id          String,
    model                 LowCardinality(String),
    pod                   LowCardinality(String),
    endpoint              LowCardinality(String),
    routing_policy        LowCardinality(String),
    routing_reason        LowCardinality(String),
    stream                Bool,
    status                UInt16,
    error                 String,
    prompt_tokens         UInt32,
    cached_tokens         UInt32,
    completion_tokens     UInt32,
    ttft_ms               Float64,
    e2e_ms                Float64,
    queue_wait_ms         Nullable(Float64),
    tool_latency_ms       Nullable(Float64),
    system_hash           String,
    system_norm_hash      String,
    system_tokens         UInt32,
    tools_hash            String,
    tools_canonical_hash  String,
    tools_tokens          UInt32,
    retrieval_pack_hash   String,
    retrieval_set_hash    String,
    retrieval_tokens      UInt32,
    history_prefix_hash   String,
    prev_history_hash     String,
    history_tokens        UInt32,
    suffix_hash           String,
    suffix_tokens         UInt32,
    prompt_fingerprint    String,
    token_count_method    LowCardinality(String),
    ingested_at           DateTime64(3, 'UTC') DEFAULT now64(3),
    order_key             UInt64 MATERIALIZED
        toUInt64(toUnixTimestamp64Milli(ts)) * 1048576 + bitShiftRight(reinterpretAsUInt32(substring(MD5(request_id), 1, 4)), 12),
    predecessor_keys      Array(Tuple(kind UInt8, key UInt64)) MATERIALIZED arrayFilter(k -> k.2 != 0, [
        (1, if(conversation_id != '', cityHash64(1, tenant_id, model, conversation_id), 0)),
        (2, if(agent_run_id != '', cityHash64(2, tenant_id, model, agent_run_id), 0)),
        (3, if(prompt_fingerprint != '' AND system_tokens + tools_tokens + retrieval_tokens + history_tokens > 0,
               cityHash64(3, model, prompt_fingerprint), 0)),
        (4, if(system_norm_hash != '', cityHash64(4, tenant_id, model, system_norm_hash), 0)),
        (5, if(tools_canonical_hash != '', cityHash64(5, tenant_id, model, tools_canonical_hash), 0)),
        (6, if(retrieval_set_hash != '', cityHash64(6, tenant_id, model, retrieval_set_hash), 0))]),
    INDEX ingested_at_minmax ingested_at TYPE minmax GRANULARITY 1,
    INDEX order_key_minmax order_key TYPE minmax GRANULARITY 1
)
ENGINE = MergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (tenant_id, ts, request_id)
TTL toDateTime(ts) + INTERVAL 30 DAY;

-- served_requests read gateway_requests FINAL; MergeTree has no FINAL and needs none now.
CREATE OR REPLACE VIEW served_requests AS
SELECT *
FROM gateway_requests
WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
  AND ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND ({pod:String} = '' OR pod = {pod:String})
  AND status < 400 AND prompt_tokens > 0;

-- request_keys: one row per (request, predecessor key) of every request that can be a predecessor (served,
-- with a prompt), sorted by key then arrival order, so the attribution job finds "the latest earlier request
-- on this key" (and "the next later one") with an ASOF JOIN that reads only the keys it asks for.
-- Fed at insert by the materialized view below: exact because gateway_requests is written exactly once.
CREATE TABLE IF NOT EXISTS request_keys
(
    key         UInt64,
    kind        UInt8,
    order_key   UInt64,
    ts          DateTime64(3, 'UTC'),
    request_id  String
)
ENGINE = MergeTree
PARTITION BY toYYYYMMDD(ts)
ORDER BY (key, order_key)
TTL toDateTime(ts) + INTERVAL 30 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS request_keys_mv TO request_keys AS
SELECT k.key AS key, k.kind AS kind, order_key, ts, request_id
FROM gateway_requests
ARRAY JOIN predecessor_keys AS k
WHERE status < 400 AND prompt_tokens > 0;
