-- Predecessor keys 11 to 16 (ingest/attribution.py predecessor_keys, KEY_MESSAGES .. KEY_PREFILL_HISTORY): a
-- conversation's previous turn by its messages, for clients that send no conversation or run id (a plain OpenAI
-- client). Without them such a turn found only a variant predecessor, the latest request with the same system
-- prompt (another user's, on a shared app), and read its own history as new. Three asymmetric pairs, each under
-- (tenant, model, cache_salt_hash, system_norm_hash), the two of a pair hashed with one seed so a turn's looked-up
-- key equals its previous turn's found key:
-- * 11, the request's messages as sent (history_prefix_hash, suffix_hash); 12, its previous request's as this
--   history carries them with the reply after them (prev_history_hash, prev_suffix_hash);
-- * 13, its messages as one history (next_history_hash); 14, its history (history_prefix_hash): the previous
--   request re-sent with no reply between (a message sent before the reply came).
-- * 15, the history of an assistant prefill (continue_final_message); 16, the history before this request's last
--   run of assistant messages (prefill_history_hash): the turn after a prefill.
-- The attribution job looks requests up on 12, 14 and 16 only, and finds on them only what was found on its own
-- 11, 13 or 15 (ingest/key_tails.py CANDIDATE_ROWS); ranked after the id keys (1, 2, 9, 10) as a previous turn.
-- Only a request with neither conversation_id nor agent_run_id has keys 11-16: a client that sends ids finds its
-- turns on them, and every key costs the predecessor search a row per request. Kinds 1-10 are those of 0043.
-- Rows stored before this migration keep the keys they had: a turn after
-- them finds them on the other keys, as before.
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
                cityHash64(15, tenant_id, model, cache_salt_hash, system_norm_hash, prefill_history_hash), 0))]);
