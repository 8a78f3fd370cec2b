-- prefill_rate(since, until, model): each pod's measured prefill seconds per computed prompt token over
-- [since, until), the rate a missed token costs to re-compute (docs/miss-causes.md, "Cost of a miss"):
--
--     seconds_per_token(pod) = Δ vllm:request_prefill_time_seconds_sum
--                              / (Δ vllm:prompt_tokens_total − Δ vllm:prefix_cache_hits_total)
--
-- (vLLM v1 metrics/loggers.py; older servers: vllm:gpu_prefix_cache_hits_total). Only pods that measured both
-- in the window are listed; a reader gives the others the fleet's rate, Σ prefill_seconds / Σ computed_tokens
-- over these rows. `model` = '' keeps every model_name. Read by the named queries miss_causes, ttl_survival,
-- ttl_hold_time and ttl_runs, so every GPU-second kvscope shows comes from this one formula.
CREATE OR REPLACE VIEW prefill_rate AS
SELECT CAST(pod AS String) AS pod_name,
       sumIf(increase, name = 'vllm:request_prefill_time_seconds_sum') AS prefill_seconds,
       sumIf(increase, name = 'vllm:prompt_tokens_total')
         - sumIf(increase, name IN ('vllm:prefix_cache_hits_total', 'vllm:gpu_prefix_cache_hits_total'))
         AS computed_tokens,
       prefill_seconds / computed_tokens AS seconds_per_token
FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1,
                 names = ['vllm:request_prefill_time_seconds_sum', 'vllm:prompt_tokens_total',
                          'vllm:prefix_cache_hits_total', 'vllm:gpu_prefix_cache_hits_total'])
WHERE {model:String} = '' OR model_name = {model:String}
GROUP BY pod_name
HAVING prefill_seconds > 0 AND computed_tokens > 0;
