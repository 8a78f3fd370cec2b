-- skip_reading_prefix_cache (docs/gateway-log.md): vLLM read no prefix cache for the request (it asked for prompt
-- logprobs; vLLM's SamplingParams.skip_reading_prefix_cache). vLLM counts such a request in neither
-- vllm:prefix_cache_queries nor vllm:prefix_cache_hits, so its cached count is stored NULL (not reported: the
-- hit rate leaves it out, as vLLM's does) and its missed tokens read `not_reported / skip_reading_prefix_cache`
-- (docs/miss-causes.md). false for rows stored before this migration.
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS skip_reading_prefix_cache Bool DEFAULT false AFTER stream;
