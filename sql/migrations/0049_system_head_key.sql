-- Predecessor key 20 (ingest/attribution.py predecessor_keys, KEY_SYSTEM_HEAD, system_head): the system prompt's
-- instruction head (tenant, model, cache_salt_hash, the system line hashes before its first blank line, a line of 0
-- tokens), for a system prompt whose first blank line is neither its first nor its last line and whose head holds at
-- least 16 tokens (MIN_HEAD_TOKENS). A client that puts retrieved documents into the system prompt after a fixed
-- instruction (LangChain's create_retrieval_chain / "stuff documents") changes every other key with its documents:
-- the same documents reordered, or another question with new documents, read cold. A variant key, looked up and
-- found alike, taken only when no other variant key found a request. Kinds 1-19 are those of 0047. Rows stored
-- before this migration have no such key.
ALTER TABLE gateway_requests
    MODIFY COLUMN predecessor_keys Array(Tuple(kind UInt8, key UInt64)) MATERIALIZED arrayFilter(k -> k.2 != 0, [
        (1, if(conversation_id != '', cityHash64(1, tenant_id, model, conversation_id), 0)),
        (2, if(agent_run_id != '', cityHash64(2, tenant_id, model, agent_run_id), 0)),
        (3, multiIf(prompt_fingerprint != '' AND system_tokens + tools_tokens + retrieval_tokens + history_tokens > 0,
                    cityHash64(3, model, prompt_fingerprint),
                    system_tokens + tools_tokens + retrieval_tokens + history_tokens = 0 AND suffix_hash != ''
                    AND suffix_tokens >= 16, cityHash64(3, model, 'suffix', cache_salt_hash, suffix_hash), 0)),
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
                cityHash64(18, tenant_id, model, agent_run_id, first_message_hash, system_norm_hash), 0)),
        (19, if(system_tokens + tools_tokens + retrieval_tokens + history_tokens = 0
                AND length(suffix_chunk_hashes) > 0 AND suffix_chunk_tokens[1] >= 16,
                cityHash64(19, tenant_id, model, cache_salt_hash, suffix_chunk_hashes[1]), 0)),
        (20, if(indexOf(system_line_tokens, 0) > 1 AND indexOf(system_line_tokens, 0) < length(system_line_hashes)
                AND length(system_line_tokens) = length(system_line_hashes)
                AND arraySum(arraySlice(system_line_tokens, 1, indexOf(system_line_tokens, 0) - 1)) >= 16,
                cityHash64(20, tenant_id, model, cache_salt_hash,
                           arraySlice(system_line_hashes, 1, indexOf(system_line_tokens, 0) - 1)), 0))]);
