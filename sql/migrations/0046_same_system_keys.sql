-- Predecessor keys 17 and 18 (ingest/attribution.py predecessor_keys, KEY_CONVERSATION_SYSTEM, KEY_AGENT_RUN_SYSTEM):
-- one thread of a conversation (17: tenant, model, conversation_id, first_message_hash, system_norm_hash) or of an
-- agent run (18: tenant, model, agent_run_id, first_message_hash, system_norm_hash) under one system prompt. A
-- client that sends other calls with the chat's messages and id under a system prompt of their own (a guardrail or
-- judge, the router and responder nodes of an agent graph) made the id keys find that call as the chat's previous
-- turn, and the chat's system prompt read as changed (prefix_drift / system_changed over the whole prompt). The
-- attribution job never chooses these keys' candidates: when the turn the id keys found was sent under another
-- system prompt, the latest earlier one of these takes its place (ingest/attribution.py same_system_turn). Kinds
-- 1-16 are those of 0045. Rows stored before this migration have no such key: a turn after them finds its
-- predecessor as before.
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
               cityHash64(9, tenant_id, model, agent_run_id, first_message_hash), 0)),
        (10, if(conversation_id != '' AND first_message_hash != '',
                cityHash64(10, tenant_id, model, conversation_id, first_message_hash), 0)),
        (11, if(conversation_id = '' AND agent_run_id = '' AND suffix_hash != '',
                cityHash64(11, tenant_id, model, cache_salt_hash, system_norm_hash, history_prefix_hash, suffix_hash),
                0)),
        (12, if(conversation_id = '' AND agent_run_id = '' AND prev_suffix_hash != '',
                cityHash64(11, tenant_id, model, cache_salt_hash, system_norm_hash, prev_history_hash,
                           prev_suffix_hash), 0)),
        (13, if(conversation_id = '' AND agent_run_id = '' AND next_history_hash != '',
                cityHash64(13, tenant_id, model, cache_salt_hash, system_norm_hash, next_history_hash), 0)),
        (14, if(conversation_id = '' AND agent_run_id = '' AND history_prefix_hash != '',
                cityHash64(13, tenant_id, model, cache_salt_hash, system_norm_hash, history_prefix_hash), 0)),
        (15, if(conversation_id = '' AND agent_run_id = '' AND continue_final_message AND history_prefix_hash != '',
                cityHash64(15, tenant_id, model, cache_salt_hash, system_norm_hash, history_prefix_hash), 0)),
        (16, if(conversation_id = '' AND agent_run_id = '' AND prefill_history_hash != '',
                cityHash64(15, tenant_id, model, cache_salt_hash, system_norm_hash, prefill_history_hash), 0)),
        (17, if(conversation_id != '' AND first_message_hash != '',
                cityHash64(17, tenant_id, model, conversation_id, first_message_hash, system_norm_hash), 0)),
        (18, if(agent_run_id != '' AND first_message_hash != '',
                cityHash64(18, tenant_id, model, agent_run_id, first_message_hash, system_norm_hash), 0))]);
