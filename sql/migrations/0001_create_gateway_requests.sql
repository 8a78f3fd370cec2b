-- One row per request the gateway served (gateway fingerprint log, schema gateway/gateway_log.v1.schema.json).
-- ReplacingMergeTree: a re-delivered log line carries the same event_id, ts and request_id, so duplicates
-- collapse on merge and queries read with FINAL (dedup on event_id).
-- ORDER BY starts with tenant_id and ts: every panel filters by time range and most by tenant.
CREATE TABLE IF NOT EXISTS gateway_requests
(
    event_id              String,
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
    ingested_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
ORDER BY (tenant_id, ts, event_id);
