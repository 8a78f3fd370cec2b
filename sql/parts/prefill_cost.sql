    -- part prefill_cost: what re-computing a missed token costs on each pod, in GPU-seconds, over the window.
    -- Reads the parameters since, until and model. Defines:
    --   prefill_pods: the pods that measured their prefill time in the window (view prefill_rate,
    --     sql/migrations/0021: Δ vllm:request_prefill_time_seconds_sum / (Δ vllm:prompt_tokens_total
    --     − Δ vllm:prefix_cache_hits_total), vLLM v1 metrics/loggers.py; docs/miss-causes.md "Cost of a miss");
    --   fleet_seconds_per_token: Σ prefill seconds / Σ computed tokens over those pods, NULL when none measured;
    --   seconds_per_token_on(pod): the pod's own rate, else the fleet's, Nullable(Float64) seconds per token.
    prefill_pods AS
    (
        SELECT pod_name, prefill_seconds, computed_tokens, seconds_per_token
        FROM prefill_rate(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                          model = {model:String})
    ),
    (SELECT mapFromArrays(groupArray(pod_name), groupArray(seconds_per_token)) FROM prefill_pods)
        AS pod_seconds_per_token,
    (SELECT CAST(if(count() > 0, sum(prefill_seconds) / sum(computed_tokens), NULL) AS Nullable(Float64))
     FROM prefill_pods) AS fleet_seconds_per_token,
    pod -> if(mapContains(pod_seconds_per_token, pod), CAST(pod_seconds_per_token[pod] AS Nullable(Float64)),
              fleet_seconds_per_token) AS seconds_per_token_on,
