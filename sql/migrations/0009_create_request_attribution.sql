-- request_attribution: the miss-cause answer for each gateway request, one current row per request
-- (docs/miss-causes.md). The causes of its missed tokens are parallel arrays (causes[i], sub_causes[i],
-- missed_tokens[i]: tokens missed for that reason, in prompt order), summing to prompt_tokens - cached_tokens.
-- Every request gets a row, also those that missed nothing or failed (empty arrays), so "not yet attributed"
-- is an anti-join and affinity can count requests whose predecessor they hit.
--
-- VersionedCollapsingMergeTree(sign, version): when a later run reaches another answer (a late predecessor
-- arrived), the job writes, in one INSERT, the old row again with sign = -1 (same version) and the new row
-- with sign = +1 and version + 1. Sums weighted by sign are exact at any moment, before or after merges,
-- which also keeps materialized rollups fed from this table exact; merges drop the cancelled pairs.
-- A rerun that reaches the same answer writes nothing. One writer only (the attribution job).
CREATE TABLE IF NOT EXISTS request_attribution
(
    request_id              String,
    ts                      DateTime64(3, 'UTC'),
    tenant_id               LowCardinality(String),
    pod                     LowCardinality(String),
    model                   LowCardinality(String),
    prompt_tokens           UInt32,
    cached_tokens           UInt32,
    predecessor_request_id  String,
    predecessor_pod         LowCardinality(String),
    predecessor_kind        LowCardinality(String),
    gap_ms                  Nullable(Float64),
    block_size              UInt32,
    causes                  Array(LowCardinality(String)),
    sub_causes              Array(LowCardinality(String)),
    missed_tokens           Array(UInt32),
    attributed_at           DateTime64(3, 'UTC'),
    sign                    Int8,
    version                 UInt32
)
ENGINE = VersionedCollapsingMergeTree(sign, version)
PARTITION BY toYYYYMMDD(ts)
ORDER BY (tenant_id, ts, request_id)
TTL toDateTime(ts) + INTERVAL 30 DAY;

-- The 0.1 table held one row per (request, cause) and kept stale causes after a re-attribution. Its content
-- is derived data: the job re-attributes every stored request from scratch (watermark reset below).
-- if: SELECT count() FROM system.tables WHERE database = currentDatabase() AND name = 'miss_attribution' AND engine != 'View'
DROP TABLE miss_attribution;

TRUNCATE TABLE IF EXISTS attribution_watermark;

-- miss_attribution: the current answers as one row per (request, cause, sub_cause), the shape 0.1's table had,
-- for ad hoc SQL. FINAL collapses each request to its current row; bound reads by ts (partitions are days).
-- Named queries and the dashboard read request_attribution with sign-weighted sums instead.
CREATE OR REPLACE VIEW miss_attribution AS
SELECT request_id, ts, tenant_id, pod, model, cause, sub_cause, tokens, predecessor_request_id, predecessor_pod,
       predecessor_kind, gap_ms, block_size, attributed_at
FROM request_attribution FINAL
ARRAY JOIN causes AS cause, sub_causes AS sub_cause, missed_tokens AS tokens;
