-- engine_requests: how many engine requests vLLM ran for a logged request, n (parallel samples) times its prompts (a
-- completions prompt list): gateway/fingerprint.py engine_requests, docs/gateway-log.md. vLLM counts each one in
-- vllm:request_success_total and looks each one's whole prompt up in the prefix cache, and the response's cached
-- count is one sequence's, so a request with more than one is stored with its cached count NULL (not reported).
-- The data-quality check read such traffic as requests_not_seen_by_gateway (vLLM finished more requests than the
-- gateway logged): it now compares vLLM's finished requests with the engine requests logged, and names the
-- prompt tokens of such requests (fan_out_prompt_tokens) as a cause of a gap (sql/queries/data_quality.sql).
-- * gateway_requests gains engine_requests (1 for rows stored before this migration and for gateways that do not
--   log it);
-- * requests_1m / requests_1h gain engine_requests (rows already in the rollups read their served count: one
--   engine request each) and fan_out_prompt_tokens (0);
-- * the materialized views are recreated to write them (as in 0041: run migrations before ingesting; kvscope does).

DROP VIEW IF EXISTS requests_1h_mv;

DROP VIEW IF EXISTS requests_1m_mv;

ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS engine_requests UInt16 DEFAULT 1 AFTER continue_final_message;

ALTER TABLE requests_1m
    ADD COLUMN IF NOT EXISTS engine_requests SimpleAggregateFunction(sum, UInt64) DEFAULT served,
    ADD COLUMN IF NOT EXISTS fan_out_prompt_tokens SimpleAggregateFunction(sum, UInt64) DEFAULT 0;

ALTER TABLE requests_1h
    ADD COLUMN IF NOT EXISTS engine_requests SimpleAggregateFunction(sum, UInt64) DEFAULT served,
    ADD COLUMN IF NOT EXISTS fan_out_prompt_tokens SimpleAggregateFunction(sum, UInt64) DEFAULT 0;

-- served = the served_requests rule: status < 400 and a known prompt; known = served with a cached count;
-- skipped = served, read no prefix cache (no cached count by design); engine_requests = vLLM's engine requests of the
-- served requests; fan_out = served, run as several engine requests (no cached count by design).
CREATE MATERIALIZED VIEW IF NOT EXISTS requests_1m_mv TO requests_1m AS
SELECT
    toStartOfMinute(g.ts) AS minute, g.tenant_id AS tenant_id, g.pod AS pod, g.model AS model,
    count() AS requests,
    countIf(g.status < 400 AND g.prompt_tokens > 0) AS served,
    countIf(g.status >= 400) AS errors,
    sumIf(toUInt64(g.prompt_tokens), g.status < 400 AND g.prompt_tokens > 0) AS prompt_tokens,
    sumIf(toUInt64(ifNull(g.cached_tokens, 0)), g.status < 400 AND g.prompt_tokens > 0) AS cached_tokens,
    sumIf(toUInt64(g.completion_tokens), g.status < 400 AND g.prompt_tokens > 0) AS completion_tokens,
    sumIf(toUInt64(greatest(toInt64(g.prompt_tokens) - toInt64(g.suffix_tokens), 0)),
          g.status < 400 AND g.prompt_tokens > 0) AS prefix_tokens,
    sumIf(ifNull(g.cached_tokens, 0) / g.prompt_tokens,
          g.status < 400 AND g.prompt_tokens > 0 AND g.cached_tokens IS NOT NULL) AS hit_ratio_sum,
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
    uniqCombinedStateIf(g.retrieval_set_hash, g.retrieval_set_hash != '') AS retrieval_set_hashes,
    countIf(g.status < 400 AND g.prompt_tokens > 0 AND g.cached_tokens IS NOT NULL) AS known_served,
    sumIf(toUInt64(g.prompt_tokens), g.status < 400 AND g.prompt_tokens > 0 AND g.cached_tokens IS NOT NULL)
        AS known_prompt_tokens,
    sumIf(toUInt64(g.prompt_tokens),
          g.status < 400 AND g.prompt_tokens > 0 AND g.cached_tokens IS NULL AND g.skip_reading_prefix_cache)
        AS skipped_prompt_tokens,
    sumIf(toUInt64(g.engine_requests), g.status < 400 AND g.prompt_tokens > 0) AS engine_requests,
    sumIf(toUInt64(g.prompt_tokens), g.status < 400 AND g.prompt_tokens > 0 AND g.engine_requests > 1)
        AS fan_out_prompt_tokens
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
    uniqCombinedMergeState(r.retrieval_set_hashes) AS retrieval_set_hashes,
    sum(r.known_served) AS known_served, sum(r.known_prompt_tokens) AS known_prompt_tokens,
    sum(r.skipped_prompt_tokens) AS skipped_prompt_tokens,
    sum(r.engine_requests) AS engine_requests, sum(r.fan_out_prompt_tokens) AS fan_out_prompt_tokens
FROM requests_1m AS r
GROUP BY minute, tenant_id, pod, model;

-- The same text as in 0012, 0014 and 0041: recreated so that `*` covers the new column on every server version.
CREATE OR REPLACE VIEW requests_rollup AS
WITH toStartOfMinute({since:DateTime64(3, 'UTC')}) AS s, {until:DateTime64(3, 'UTC')} AS u,
     toStartOfHour(s) + if(toStartOfHour(s) = s, 0, 3600) AS h0, toStartOfHour(u) AS h1,
     {hourly:UInt8} = 1 AND h0 < h1 AS split
SELECT minute AS t, * EXCEPT minute FROM requests_1m
WHERE minute >= s AND minute < u AND (NOT split OR minute < h0 OR minute >= h1)
UNION ALL
SELECT minute AS t, * EXCEPT minute FROM requests_1h
WHERE split AND minute >= h0 AND minute < h1;
