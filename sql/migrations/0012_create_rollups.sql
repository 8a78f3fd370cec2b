-- Rollups: every dashboard panel and named query reads these, not the raw tables (docs/scale.md).
-- Materialized views fill them at insert time from tables that are written exactly once (gateway_requests,
-- vllm_metrics; the ingester drops duplicates) or whose rows carry a sign (request_attribution: a replaced
-- answer comes back with sign -1), so the sums are exact without FINAL.
-- AggregatingMergeTree: sums as SimpleAggregateFunction(sum), latency quantiles as t-digest states (mergeable
-- across minutes, hours and pods; a small set keeps every value, so a p99 of 5 requests is the largest, not an
-- interpolation; DDSketch was measured and dropped: it reports a lower rank, a p95 of {15, 70} ms read 15),
-- distinct counts as uniqCombined states.
-- Minute tables for recent, fine-grained panels; hour tables (fed from the minute tables) for long ranges.
-- The *_rollup parameterized views read whole hours from the hour table and the edges from the minute table.

CREATE TABLE IF NOT EXISTS requests_1m
(
    minute                  DateTime('UTC'),
    tenant_id               LowCardinality(String),
    pod                     LowCardinality(String),
    model                   LowCardinality(String),
    requests                SimpleAggregateFunction(sum, UInt64),
    served                  SimpleAggregateFunction(sum, UInt64),
    errors                  SimpleAggregateFunction(sum, UInt64),
    prompt_tokens           SimpleAggregateFunction(sum, UInt64),
    cached_tokens           SimpleAggregateFunction(sum, UInt64),
    completion_tokens       SimpleAggregateFunction(sum, UInt64),
    prefix_tokens           SimpleAggregateFunction(sum, UInt64),
    hit_ratio_sum           SimpleAggregateFunction(sum, Float64),
    queue_wait_samples      SimpleAggregateFunction(sum, UInt64),
    ttft_ms                 AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float64),
    queue_wait_ms           AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float64),
    e2e_ms                  AggregateFunction(quantilesTDigest(0.5, 0.95, 0.99), Float64),
    fingerprints            AggregateFunction(uniqCombined, String),
    system_hashes           AggregateFunction(uniqCombined, String),
    system_norm_hashes      AggregateFunction(uniqCombined, String),
    tools_hashes            AggregateFunction(uniqCombined, String),
    tools_canonical_hashes  AggregateFunction(uniqCombined, String),
    retrieval_pack_hashes   AggregateFunction(uniqCombined, String),
    retrieval_set_hashes    AggregateFunction(uniqCombined, String)
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (minute, tenant_id, pod, model)
TTL minute + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS requests_1h AS requests_1m
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (minute, tenant_id, pod, model)
TTL minute + INTERVAL 400 DAY;

-- served = the served_requests rule: status < 400 and a known prompt; latencies of served requests only.
CREATE MATERIALIZED VIEW IF NOT EXISTS requests_1m_mv TO requests_1m AS
SELECT
    toStartOfMinute(g.ts) AS minute, g.tenant_id AS tenant_id, g.pod AS pod, g.model AS model,
    count() AS requests,
    countIf(g.status < 400 AND g.prompt_tokens > 0) AS served,
    countIf(g.status >= 400) AS errors,
    sumIf(toUInt64(g.prompt_tokens), g.status < 400 AND g.prompt_tokens > 0) AS prompt_tokens,
    sumIf(toUInt64(g.cached_tokens), g.status < 400 AND g.prompt_tokens > 0) AS cached_tokens,
    sumIf(toUInt64(g.completion_tokens), g.status < 400 AND g.prompt_tokens > 0) AS completion_tokens,
    sumIf(toUInt64(greatest(toInt64(g.prompt_tokens) - toInt64(g.suffix_tokens), 0)),
          g.status < 400 AND g.prompt_tokens > 0) AS prefix_tokens,
    sumIf(g.cached_tokens / g.prompt_tokens, g.status < 400 AND g.prompt_tokens > 0) AS hit_ratio_sum,
    countIf(g.status < 400 AND g.queue_wait_ms IS NOT NULL) AS queue_wait_samples,
    quantilesTDigestStateIf(0.5, 0.95, 0.99)(g.ttft_ms, g.status < 400) AS ttft_ms,
    quantilesTDigestStateIf(0.5, 0.95, 0.99)(assumeNotNull(g.queue_wait_ms),
                                               g.status < 400 AND g.queue_wait_ms IS NOT NULL) AS queue_wait_ms,
    quantilesTDigestStateIf(0.5, 0.95, 0.99)(g.e2e_ms, g.status < 400) AS e2e_ms,
    uniqCombinedStateIf(g.prompt_fingerprint, g.prompt_fingerprint != '') AS fingerprints,
    uniqCombinedStateIf(g.system_hash, g.system_hash != '') AS system_hashes,
    uniqCombinedStateIf(g.system_norm_hash, g.system_norm_hash != '') AS system_norm_hashes,
    uniqCombinedStateIf(g.tools_hash, g.tools_hash != '') AS tools_hashes,
    uniqCombinedStateIf(g.tools_canonical_hash, g.tools_canonical_hash != '') AS tools_canonical_hashes,
    uniqCombinedStateIf(g.retrieval_pack_hash, g.retrieval_pack_hash != '') AS retrieval_pack_hashes,
    uniqCombinedStateIf(g.retrieval_set_hash, g.retrieval_set_hash != '') AS retrieval_set_hashes
FROM gateway_requests AS g
GROUP BY minute, tenant_id, pod, model;

CREATE MATERIALIZED VIEW IF NOT EXISTS requests_1h_mv TO requests_1h AS
SELECT
    toStartOfHour(r.minute) AS minute, r.tenant_id AS tenant_id, r.pod AS pod, r.model AS model,
    sum(r.requests) AS requests, sum(r.served) AS served, sum(r.errors) AS errors,
    sum(r.prompt_tokens) AS prompt_tokens, sum(r.cached_tokens) AS cached_tokens,
    sum(r.completion_tokens) AS completion_tokens, sum(r.prefix_tokens) AS prefix_tokens,
    sum(r.hit_ratio_sum) AS hit_ratio_sum, sum(r.queue_wait_samples) AS queue_wait_samples,
    quantilesTDigestMergeState(0.5, 0.95, 0.99)(r.ttft_ms) AS ttft_ms,
    quantilesTDigestMergeState(0.5, 0.95, 0.99)(r.queue_wait_ms) AS queue_wait_ms,
    quantilesTDigestMergeState(0.5, 0.95, 0.99)(r.e2e_ms) AS e2e_ms,
    uniqCombinedMergeState(r.fingerprints) AS fingerprints,
    uniqCombinedMergeState(r.system_hashes) AS system_hashes,
    uniqCombinedMergeState(r.system_norm_hashes) AS system_norm_hashes,
    uniqCombinedMergeState(r.tools_hashes) AS tools_hashes,
    uniqCombinedMergeState(r.tools_canonical_hashes) AS tools_canonical_hashes,
    uniqCombinedMergeState(r.retrieval_pack_hashes) AS retrieval_pack_hashes,
    uniqCombinedMergeState(r.retrieval_set_hashes) AS retrieval_set_hashes
FROM requests_1m AS r
GROUP BY minute, tenant_id, pod, model;

-- Missed tokens by cause: sums weighted by sign, so a replaced answer cancels itself.
CREATE TABLE IF NOT EXISTS misses_1m
(
    minute         DateTime('UTC'),
    tenant_id      LowCardinality(String),
    pod            LowCardinality(String),
    model          LowCardinality(String),
    cause          LowCardinality(String),
    sub_cause      LowCardinality(String),
    missed_tokens  SimpleAggregateFunction(sum, Int64),
    requests       SimpleAggregateFunction(sum, Int64)
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (minute, tenant_id, pod, model, cause, sub_cause)
TTL minute + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS misses_1h AS misses_1m
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (minute, tenant_id, pod, model, cause, sub_cause)
TTL minute + INTERVAL 400 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS misses_1m_mv TO misses_1m AS
SELECT toStartOfMinute(a.ts) AS minute, a.tenant_id AS tenant_id, a.pod AS pod, a.model AS model,
       c AS cause, sc AS sub_cause, sum(toInt64(n) * a.sign) AS missed_tokens, sum(toInt64(a.sign)) AS requests
FROM request_attribution AS a
ARRAY JOIN a.causes AS c, a.sub_causes AS sc, a.missed_tokens AS n
GROUP BY minute, tenant_id, pod, model, cause, sub_cause;

CREATE MATERIALIZED VIEW IF NOT EXISTS misses_1h_mv TO misses_1h AS
SELECT toStartOfHour(m.minute) AS minute, m.tenant_id AS tenant_id, m.pod AS pod, m.model AS model,
       m.cause AS cause, m.sub_cause AS sub_cause, sum(m.missed_tokens) AS missed_tokens, sum(m.requests) AS requests
FROM misses_1m AS m
GROUP BY minute, tenant_id, pod, model, cause, sub_cause;

-- Cache affinity (DESIGN: tenant_cache_affinity): of the requests whose predecessor shares their prefix (the
-- previous turn, or the same fingerprint), the prompt tokens served by the predecessor's pod. Sign-weighted.
CREATE TABLE IF NOT EXISTS affinity_1m
(
    minute               DateTime('UTC'),
    tenant_id            LowCardinality(String),
    pod                  LowCardinality(String),
    model                LowCardinality(String),
    answered             SimpleAggregateFunction(sum, Int64),
    with_predecessor     SimpleAggregateFunction(sum, Int64),
    predecessor_tokens   SimpleAggregateFunction(sum, Int64),
    same_pod_tokens      SimpleAggregateFunction(sum, Int64)
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (minute, tenant_id, pod, model)
TTL minute + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS affinity_1h AS affinity_1m
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (minute, tenant_id, pod, model)
TTL minute + INTERVAL 400 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS affinity_1m_mv TO affinity_1m AS
SELECT toStartOfMinute(a.ts) AS minute, a.tenant_id AS tenant_id, a.pod AS pod, a.model AS model,
       sum(toInt64(a.sign)) AS answered,
       sumIf(toInt64(a.sign), a.predecessor_kind IN ('previous_turn', 'fingerprint')) AS with_predecessor,
       sumIf(toInt64(a.prompt_tokens) * a.sign, a.predecessor_kind IN ('previous_turn', 'fingerprint'))
           AS predecessor_tokens,
       sumIf(toInt64(a.prompt_tokens) * a.sign,
             a.predecessor_kind IN ('previous_turn', 'fingerprint') AND a.predecessor_pod = a.pod) AS same_pod_tokens
FROM request_attribution AS a
GROUP BY minute, tenant_id, pod, model;

CREATE MATERIALIZED VIEW IF NOT EXISTS affinity_1h_mv TO affinity_1h AS
SELECT toStartOfHour(f.minute) AS minute, f.tenant_id AS tenant_id, f.pod AS pod, f.model AS model,
       sum(f.answered) AS answered, sum(f.with_predecessor) AS with_predecessor,
       sum(f.predecessor_tokens) AS predecessor_tokens, sum(f.same_pod_tokens) AS same_pod_tokens
FROM affinity_1m AS f
GROUP BY minute, tenant_id, pod, model;

-- vLLM series per minute: counter increases summed; gauges as last, max and mean.
CREATE TABLE IF NOT EXISTS vllm_1m
(
    minute      DateTime('UTC'),
    pod         LowCardinality(String),
    engine      LowCardinality(String),
    model_name  LowCardinality(String),
    name        LowCardinality(String),
    label       LowCardinality(String),
    increase    SimpleAggregateFunction(sum, Float64),
    value_sum   SimpleAggregateFunction(sum, Float64),
    value_max   SimpleAggregateFunction(max, Float64),
    samples     SimpleAggregateFunction(sum, UInt64),
    last_ts     SimpleAggregateFunction(max, DateTime64(3, 'UTC')),
    last_value  AggregateFunction(argMax, Float64, DateTime64(3, 'UTC'))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (name, minute, pod, engine, model_name, label)
TTL minute + INTERVAL 400 DAY;

CREATE TABLE IF NOT EXISTS vllm_1h AS vllm_1m
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(minute)
ORDER BY (name, minute, pod, engine, model_name, label)
TTL minute + INTERVAL 400 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS vllm_1m_mv TO vllm_1m AS
SELECT toStartOfMinute(v.ts) AS minute, v.pod AS pod, v.engine AS engine, v.model_name AS model_name,
       v.name AS name, v.label AS label, sum(v.increase) AS increase, sum(v.value) AS value_sum,
       max(v.value) AS value_max, count() AS samples, max(v.ts) AS last_ts, argMaxState(v.value, v.ts) AS last_value
FROM vllm_metrics AS v
GROUP BY minute, pod, engine, model_name, name, label;

CREATE MATERIALIZED VIEW IF NOT EXISTS vllm_1h_mv TO vllm_1h AS
SELECT toStartOfHour(m.minute) AS minute, m.pod AS pod, m.engine AS engine, m.model_name AS model_name,
       m.name AS name, m.label AS label, sum(m.increase) AS increase, sum(m.value_sum) AS value_sum,
       max(m.value_max) AS value_max, sum(m.samples) AS samples, max(m.last_ts) AS last_ts,
       argMaxMergeState(m.last_value) AS last_value
FROM vllm_1m AS m
GROUP BY minute, pod, engine, model_name, name, label;

-- Reading rollups: <x>_rollup(since, until, hourly) returns the rows of [since, until) at minute resolution,
-- taking whole hours from the hour table when hourly = 1 (callers pass 1 when their buckets are whole hours,
-- or they want no buckets) and the edges from the minute table. `t` is the row's minute or hour. Windows are
-- resolved to whole minutes (a minute is in when its start is).
CREATE OR REPLACE VIEW requests_rollup AS
WITH toStartOfMinute({since:DateTime64(3, 'UTC')}) AS s, {until:DateTime64(3, 'UTC')} AS u,
     toStartOfHour(s) + if(toStartOfHour(s) = s, 0, 3600) AS h0, toStartOfHour(u) AS h1,
     {hourly:UInt8} = 1 AND h0 < h1 AS split
SELECT minute AS t, * EXCEPT minute FROM requests_1m
WHERE minute >= s AND minute < u AND (NOT split OR minute < h0 OR minute >= h1)
UNION ALL
SELECT minute AS t, * EXCEPT minute FROM requests_1h
WHERE split AND minute >= h0 AND minute < h1;

CREATE OR REPLACE VIEW misses_rollup AS
WITH toStartOfMinute({since:DateTime64(3, 'UTC')}) AS s, {until:DateTime64(3, 'UTC')} AS u,
     toStartOfHour(s) + if(toStartOfHour(s) = s, 0, 3600) AS h0, toStartOfHour(u) AS h1,
     {hourly:UInt8} = 1 AND h0 < h1 AS split
SELECT minute AS t, * EXCEPT minute FROM misses_1m
WHERE minute >= s AND minute < u AND (NOT split OR minute < h0 OR minute >= h1)
UNION ALL
SELECT minute AS t, * EXCEPT minute FROM misses_1h
WHERE split AND minute >= h0 AND minute < h1;

CREATE OR REPLACE VIEW affinity_rollup AS
WITH toStartOfMinute({since:DateTime64(3, 'UTC')}) AS s, {until:DateTime64(3, 'UTC')} AS u,
     toStartOfHour(s) + if(toStartOfHour(s) = s, 0, 3600) AS h0, toStartOfHour(u) AS h1,
     {hourly:UInt8} = 1 AND h0 < h1 AS split
SELECT minute AS t, * EXCEPT minute FROM affinity_1m
WHERE minute >= s AND minute < u AND (NOT split OR minute < h0 OR minute >= h1)
UNION ALL
SELECT minute AS t, * EXCEPT minute FROM affinity_1h
WHERE split AND minute >= h0 AND minute < h1;

-- vllm_rollup also takes the metric names wanted: the tables are sorted by name first.
CREATE OR REPLACE VIEW vllm_rollup AS
WITH toStartOfMinute({since:DateTime64(3, 'UTC')}) AS s, {until:DateTime64(3, 'UTC')} AS u,
     toStartOfHour(s) + if(toStartOfHour(s) = s, 0, 3600) AS h0, toStartOfHour(u) AS h1,
     {hourly:UInt8} = 1 AND h0 < h1 AS split
SELECT minute AS t, * EXCEPT minute FROM vllm_1m
WHERE name IN {names:Array(String)} AND minute >= s AND minute < u AND (NOT split OR minute < h0 OR minute >= h1)
UNION ALL
SELECT minute AS t, * EXCEPT minute FROM vllm_1h
WHERE name IN {names:Array(String)} AND split AND minute >= h0 AND minute < h1;

-- key_stage: scratch sets of (request_id, ts) that a query joins instead of binding 10^5 ids as a parameter
-- (the attribution job's chunks, a bulk import's dedup check). Each writer uses its own set names and replaces
-- a set before reusing it; Memory: nothing to keep across restarts.
CREATE TABLE IF NOT EXISTS key_stage
(
    set         LowCardinality(String),
    request_id  String,
    ts          DateTime64(3, 'UTC')
)
ENGINE = Memory;
