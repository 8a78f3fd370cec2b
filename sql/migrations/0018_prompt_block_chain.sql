-- Precise mode (docs/kv-events.md): the prompt's KV block chain as the gateway logged it, so attribution can
-- match the exact blocks of each request against what each pod held (kv_block_log / kv_block_residency).
--
-- prompt_block_hashes: kvscope's chain hash (kvscope/block_hash.py chain_hashes: vLLM's default sha256 block
-- hash, low 64 bits) of each *full* block of the prompt's token ids as the serving pod prefills them, in block
-- order; [] when the gateway did not know the token ids or the pod's block size (fingerprint-only mode).
-- prompt_block_size: tokens per block those hashes were computed with (0 = no chain).
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS prompt_block_hashes Array(UInt64),
    ADD COLUMN IF NOT EXISTS prompt_block_size UInt32 DEFAULT 0;
