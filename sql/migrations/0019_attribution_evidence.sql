-- Precise mode (docs/miss-causes.md "Precise mode"): every answer says which evidence its routed_away / evicted
-- part rests on.
--
-- evidence: 'kv_events' (the request's block chain, gateway_requests.prompt_block_hashes, matched against the
-- pods' KV events, kv_block_log / kv_cache_resets), 'inferred' (routed_away / evicted concluded from the
-- predecessor's pod, no KV evidence) or 'fingerprints' (segment hashes alone: no routed_away / evicted part).
-- Rows written before this migration get 'inferred' or 'fingerprints' from their causes.
-- evidence_pod: the pod that held the first missed block (kv_events: the holder for routed_away, this pod for
-- evicted); '' otherwise. evidence_removed_at: when that block left this pod (evicted), NULL otherwise.
ALTER TABLE request_attribution
    ADD COLUMN IF NOT EXISTS evidence LowCardinality(String)
        DEFAULT if(has(causes, 'routed_away') OR has(causes, 'evicted'), 'inferred', 'fingerprints')
        AFTER missed_tokens,
    ADD COLUMN IF NOT EXISTS evidence_pod LowCardinality(String) DEFAULT '' AFTER evidence,
    ADD COLUMN IF NOT EXISTS evidence_removed_at Nullable(DateTime64(3, 'UTC')) AFTER evidence_pod;

-- miss_attribution (sql/migrations/0009) with the evidence columns.
CREATE OR REPLACE VIEW miss_attribution AS
SELECT request_id, ts, tenant_id, pod, model, cause, sub_cause, tokens, predecessor_request_id, predecessor_pod,
       predecessor_kind, gap_ms, block_size, evidence, evidence_pod, evidence_removed_at, attributed_at
FROM request_attribution FINAL
ARRAY JOIN causes AS cause, sub_causes AS sub_cause, missed_tokens AS tokens;
