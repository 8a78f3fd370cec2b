-- An assistant prefill (docs/gateway-log.md): continue_final_message says vLLM continued the request's final
-- assistant message (the reply extends it), prefill_history_hash is a request's history before its last run of
-- assistant messages. A turn whose prefill_history_hash equals its previous turn's history_prefix_hash, that turn
-- having continued its final message, carries that turn's whole prompt (the prefill, completed): it continued the
-- conversation (ingest/attribution.py _prefill_completed), not `prefix_drift / history_truncated`. false / '' for
-- rows stored before this migration and for gateways that do not log them.
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS continue_final_message Bool DEFAULT false AFTER skip_reading_prefix_cache,
    ADD COLUMN IF NOT EXISTS prefill_history_hash String DEFAULT '' AFTER first_message_hash;
