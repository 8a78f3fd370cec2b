-- Predecessor keys 9 and 10 (ingest/attribution.py predecessor_keys: one thread of an agent run or a conversation)
-- also hold the thread's normalized system prompt (system_norm_hash: volatile values masked, so a dated system prompt
-- stays one thread). A request of the same model on the chat's id that carries the chat's messages under its own
-- instructions (an input guardrail or judge, a memory-extraction request) shares the thread's first message; on the
-- old keys it was the thread's latest request, so the next turn read `prefix_drift / system_changed` where the
-- previous turn's prefix had been evicted. Kinds 1-8 are those of 0043, unchanged. Rows stored before this migration
-- keep the keys they had: a turn after it finds an earlier thread's turn on the conversation or run key, as before
-- migration 0039.
ALTER TABLE gateway_requests
    MODIFY COLUMN predecessor_keys Array(Tuple(kind UInt8, key UInt64)) MATERIALIZED arrayFilter(k -> k.2 != 0, [
        (1, if(conversation_id != '', cityHash64(1, tenant_id, model, conversation_id), 0)),
        (2, if(agent_run_id != '', cityHash64(2, tenant_id, model, agent_run_id), 0)),
        (3, if(prompt_fingerprint != '' AND system_tokens + tools_tokens + retrieval_tokens + history_tokens > 0,
               cityHash64(3, model, prompt_fingerprint), 0)),
        (4, if(system_norm_hash != '', cityHash64(4, tenant_id, model, system_norm_hash), 0)),
        (5, if(tools_canonical_hash != '', cityHash64(5, tenant_id, model, tools_canonical_hash), 0)),
        (6, if(retrieval_set_hash != '', cityHash64(6, tenant_id, model, retrieval_set_hash), 0)),
        (7, if(length(system_line_hashes) >= 3,
               cityHash64(7, tenant_id, model, length(system_line_hashes),
                          arraySlice(system_line_hashes, 1, intDiv(length(system_line_hashes), 2))), 0)),
        (8, if(length(system_line_hashes) >= 3,
               cityHash64(8, tenant_id, model, length(system_line_hashes),
                          arraySlice(system_line_hashes, intDiv(length(system_line_hashes), 2) + 1)), 0)),
        (9, if(agent_run_id != '' AND first_message_hash != '',
               cityHash64(9, tenant_id, model, agent_run_id, first_message_hash, system_norm_hash), 0)),
        (10, if(conversation_id != '' AND first_message_hash != '',
                cityHash64(10, tenant_id, model, conversation_id, first_message_hash, system_norm_hash), 0))]);
