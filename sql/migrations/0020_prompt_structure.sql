-- Structural fingerprints (docs/miss-causes.md "Structure"): what the regex masks and whole-segment hashes cannot
-- see. Written by the gateway (gateway/fingerprint.py), checked by collector/gateway_record.py.
--
-- system_line_hashes / system_line_tokens: per line of the system prompt (split at "\n", at most 256 entries,
-- the last one holding the rest), the low 64 bits of H(line) (the log's 16 hex characters as a UInt64) and
-- its tokens. One line that changes on every request (a request id of a form no mask knows) leaves the others
-- equal, so attribution finds the predecessor and names the drift volatile_system at that line.
-- suffix_chunk_hashes / suffix_chunk_tokens: per content-defined chunk of the final message (paragraphs, at
-- most 64), H(chunk) as a UInt64 and its tokens: retrieved documents inside the user message, reordered or
-- replaced, read as rag_reordered / rag_changed instead of new content.
-- [] = the gateway did not compute them (an older gateway, or no system prompt / message).
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS system_line_hashes Array(UInt64),
    ADD COLUMN IF NOT EXISTS system_line_tokens Array(UInt32),
    ADD COLUMN IF NOT EXISTS suffix_chunk_hashes Array(UInt64),
    ADD COLUMN IF NOT EXISTS suffix_chunk_tokens Array(UInt32);

-- Predecessor keys 7 and 8 (ingest/attribution.py predecessor_keys, KEY_SYSTEM_LINES_HEAD / _TAIL): the system
-- prompt's line count with the first half of its line hashes, and with the second half, for prompts of at
-- least 3 lines. Kinds 1-6 are those of 0008, unchanged. Rows inserted before this migration keep the keys
-- they had (they have no line hashes, so no band keys either).
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
                          arraySlice(system_line_hashes, intDiv(length(system_line_hashes), 2) + 1)), 0))]);
