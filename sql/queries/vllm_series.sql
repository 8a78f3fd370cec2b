-- name: vllm_series
-- description: The vLLM-board panels per bucket and pod, from vLLM's own series: prompt and generation throughput (tokens/s), finished and failed requests per second and the error rate, preemptions per second, running and waiting requests, KV-cache usage.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all; vLLM's series carry no tenant, so rows appear only when this is ''
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): vLLM's `model_name` label
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds: a positive multiple of 60 (the rollups hold whole minutes)
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC (counter increases are stamped at the later of their two scrapes)
-- returns: pod String | pod name (the collector's name for the scrape target)
-- returns: prompt_tokens_per_s Float64 | Δ vllm:prompt_tokens_total / bucket_seconds, tokens/s (prefill throughput, cached tokens included)
-- returns: generation_tokens_per_s Float64 | Δ vllm:generation_tokens_total / bucket_seconds, tokens/s (decode throughput)
-- returns: finished_requests_per_s Float64 | Δ vllm:request_success_total over every finished_reason / bucket_seconds, requests/s
-- returns: failed_requests_per_s Float64 | Δ vllm:request_success_total{finished_reason="abort" or "error"} / bucket_seconds, requests/s
-- returns: error_rate Nullable(Float64) | failed / finished requests in the bucket, fraction 0..1; NULL when none finished
-- returns: preemptions_per_s Float64 | Δ vllm:num_preemptions_total / bucket_seconds, preemptions/s (KV-cache pressure)
-- returns: running Nullable(Float64) | vllm:num_requests_running, mean over the bucket's scrapes, summed over the pod's series (engines; replicas a proxy tells apart by a label of its own), requests
-- returns: waiting Nullable(Float64) | vllm:num_requests_waiting, mean over the bucket's scrapes, summed over the pod's series, requests
-- returns: kv_cache_usage Nullable(Float64) | vllm:kv_cache_usage_perc (older: vllm:gpu_cache_usage_perc), mean over the bucket's scrapes and over the pod's series (engines, replicas), fraction 0..1 of KV blocks held by running requests
--
-- Reads vllm_rollup (sql/migrations/0012): counter increases computed by the collector between consecutive
-- scrapes (restarts handled; docs/reliability.md), gauges as the sum and count of their samples per minute.
-- A rate is the bucket's increase over the whole bucket width, as a Prometheus increase()/range would read: a
-- bucket the data covers only in part (the window's first, the newest one still filling) reads low; the
-- dashboard marks those buckets. A gauge's mean is Σ samples / count per series (engine and label: a gauge's
-- label holds the labels kvscope does not read, e.g. a proxy's replica="b"; collector/vllm_metrics.py), then
-- summed (requests) or averaged (usage) over the pod's series; a gauge is never summed within a series.
-- Counters are summed over every series.
WITH
    per_series AS
    (
        SELECT
            toDateTime64(toStartOfInterval(t, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
            CAST(pod AS String) AS pod_name,
            engine,
            label,
            sumIf(increase, name = 'vllm:prompt_tokens_total') AS prompt_increase,
            sumIf(increase, name = 'vllm:generation_tokens_total') AS generation_increase,
            sumIf(increase, name = 'vllm:request_success_total') AS finished_increase,
            sumIf(increase, name = 'vllm:request_success_total' AND label IN ('abort', 'error')) AS failed_increase,
            sumIf(increase, name = 'vllm:num_preemptions_total') AS preemption_increase,
            if(sumIf(samples, name = 'vllm:num_requests_running') > 0,
               sumIf(value_sum, name = 'vllm:num_requests_running') / sumIf(samples, name = 'vllm:num_requests_running'),
               NULL) AS running_mean,
            if(sumIf(samples, name = 'vllm:num_requests_waiting') > 0,
               sumIf(value_sum, name = 'vllm:num_requests_waiting') / sumIf(samples, name = 'vllm:num_requests_waiting'),
               NULL) AS waiting_mean,
            if(sumIf(samples, name IN ('vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc')) > 0,
               sumIf(value_sum, name IN ('vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc'))
                   / sumIf(samples, name IN ('vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc')),
               NULL) AS usage_mean
        FROM vllm_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
                         hourly = toUInt8({bucket_seconds:UInt32} % 3600 = 0),
                         names = ['vllm:prompt_tokens_total', 'vllm:generation_tokens_total',
                                  'vllm:request_success_total', 'vllm:num_preemptions_total',
                                  'vllm:num_requests_running', 'vllm:num_requests_waiting',
                                  'vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc'])
        WHERE {tenant:String} = '' AND ({pod:String} = '' OR pod = {pod:String})
          AND ({model:String} = '' OR model_name = {model:String})
        GROUP BY bucket, pod_name, engine, label
    )
SELECT
    bucket,
    pod_name AS pod,
    sum(prompt_increase) / {bucket_seconds:UInt32} AS prompt_tokens_per_s,
    sum(generation_increase) / {bucket_seconds:UInt32} AS generation_tokens_per_s,
    sum(finished_increase) / {bucket_seconds:UInt32} AS finished_requests_per_s,
    sum(failed_increase) / {bucket_seconds:UInt32} AS failed_requests_per_s,
    if(sum(finished_increase) > 0, sum(failed_increase) / sum(finished_increase), NULL) AS error_rate,
    sum(preemption_increase) / {bucket_seconds:UInt32} AS preemptions_per_s,
    if(count(running_mean) > 0, sum(running_mean), NULL) AS running,
    if(count(waiting_mean) > 0, sum(waiting_mean), NULL) AS waiting,
    if(count(usage_mean) > 0, avg(usage_mean), NULL) AS kv_cache_usage
FROM per_series
GROUP BY bucket, pod
ORDER BY bucket, pod
