    -- part prefill_cost: what re-computing a missed token costs on each pod, in GPU-seconds, over the window.
    -- Reads the parameters since, until and model. Defines:
    --   prefill_pods: the pods that measured their prefill time in the window (view prefill_rate,
    --     sql/migrations/0021: Δ vllm:request_prefill_time_seconds_sum / (Δ vllm:prompt_tokens_total
    --     − Δ vllm:prefix_cache_hits_total), vLLM v1 metrics/loggers.py; docs/miss-causes.md "Cost of a miss");
    --   prefill_rates: (pod → its seconds per token, the fleet's: Σ prefill seconds / Σ computed tokens over those
    --     pods, NULL when none measured), read from the view once;
    --   seconds_per_token_on(pod): the pod's own rate, else the fleet's, Nullable(Float64) seconds per token.
    prefill_pods AS
    (
        SELECT pod_name, prefill_seconds, computed_tokens, seconds_per_token
        FROM prefill_rate(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                          model = {model:String})
    ),
    (SELECT (mapFromArrays(groupArray(pod_name), groupArray(seconds_per_token)),
             CAST(if(count() > 0, sum(prefill_seconds) / sum(computed_tokens), NULL) AS Nullable(Float64)))
     FROM prefill_pods) AS prefill_rates,
    pod -> if(mapContains(prefill_rates.1, pod), CAST(prefill_rates.1[pod] AS Nullable(Float64)), prefill_rates.2)
        AS seconds_per_token_on,
