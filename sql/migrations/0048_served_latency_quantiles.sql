-- The gateway's TTFT and e2e quantiles over the requests the rollups count: latency's and tenant_profile's
-- percentiles came from every line with status < 400, while their `samples` / `requests` (and every other figure
-- of those rows) count the served requests only (status < 400 AND prompt_tokens > 0: the served_requests rule).
-- A line with status 200 and prompt_tokens 0 (a stream that ended without usage whose body the fingerprinter
-- could not read; a gateway that logs 0 when usage is missing) moved the percentiles while samples said it was
-- not there.
-- * requests_1m_mv is recreated with the ttft_ms / e2e_ms states over the served requests (requests_1h_mv reads
--   requests_1m: unchanged). Rows already in the rollups keep the states they have (a t-digest cannot drop a
--   value): minutes rolled up before this migration still hold such lines in their percentiles.
-- * As in 0041 and 0044: a materialized view's query cannot be altered, so it is dropped and created again; rows
--   inserted between the two would miss the rollups, so run migrations before ingesting (kvscope does). Both
--   statements are safe to rerun.

DROP VIEW IF EXISTS requests_1m_mv;

-- served = the served_requests rule: status < 400 and a known prompt; known = served with a cached count;
-- skipped = served, read no prefix cache (no cached count by design); engine_requests = vLLM's engine requests of the
-- served requests; fan_out = served, run as several engine requests (no cached count by design); ttft_ms / e2e_ms:
-- quantiles over the served requests (the population `served` counts).
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
    quantilesTDigestStateIf(0.5, 0.95, 0.99)(g.ttft_ms, g.status < 400 AND g.prompt_tokens > 0) AS ttft_ms,
    quantilesTDigestStateIf(0.5, 0.95, 0.99)(assumeNotNull(g.queue_wait_ms),
                                               g.status < 400 AND g.queue_wait_ms IS NOT NULL) AS queue_wait_ms,
    quantilesTDigestStateIf(0.5, 0.95, 0.99)(g.e2e_ms, g.status < 400 AND g.prompt_tokens > 0) AS e2e_ms,
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
