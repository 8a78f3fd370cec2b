-- vLLM's cache_salt request field (docs/gateway-log.md, "Cache salt"): vLLM keys the salt into the prompt's first
-- KV block hash (vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys), so requests under different salts
-- share no cached prefix. The gateway logs only a hash of the salt (the salt can be a per-user secret).
--
-- cache_salt_hash: H("cache_salt", salt) as 16 lowercase hex characters (gateway/fingerprint.py cache_salt_hash);
-- '' = no salt, and for rows stored before this migration. Attribution reads it to tell a changed salt between two
-- turns of a conversation (prefix_drift / cache_salt_changed, docs/miss-causes.md).
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS cache_salt_hash String DEFAULT '';
