    -- part kv_bytes_per_token: KV-cache bytes one token takes on each pod. Reads the parameters until and
    -- kv_bytes_per_token. Defines:
    --   pod_bytes_per_token: pod → its latest vllm_cache_config before `until` (kv_cache_memory_bytes /
    --     kv_cache_size_tokens of vllm:cache_config_info, vLLM >= 0.32; sql/migrations/0011);
    --   bytes_per_token_on(pod): that pod's bytes per token, else kv_bytes_per_token (KVSCOPE_KV_BYTES_PER_TOKEN)
    --     when > 0, else NULL (unknown), Nullable(Float64) bytes.
    (SELECT mapFromArrays(groupArray(pod_name), groupArray(latest))
     FROM (SELECT CAST(pod AS String) AS pod_name, argMax(bytes_per_token, ts) AS latest
           FROM vllm_cache_config WHERE ts < {until:DateTime64(3, 'UTC')} GROUP BY pod_name)) AS pod_bytes_per_token,
    pod -> multiIf(pod_bytes_per_token[pod] > 0, pod_bytes_per_token[pod],
                   {kv_bytes_per_token:Float64} > 0, {kv_bytes_per_token:Float64}, CAST(NULL AS Nullable(Float64)))
        AS bytes_per_token_on,
