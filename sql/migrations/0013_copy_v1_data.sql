-- Once, for a store written by kvscope 0.1: copy its rows into the new tables, now that every materialized view
-- fed from them exists (request_keys, the rollups), then drop the 0.1 tables. Guarded so a rerun copies nothing
-- twice. A fresh store has no 0.1 rows and skips every step.

-- Gateway requests, deduplicated there with FINAL.
-- if: SELECT (SELECT count() FROM system.tables WHERE database = currentDatabase() AND name = 'gateway_requests_v1') > 0 AND (SELECT count() FROM gateway_requests) = 0
INSERT INTO gateway_requests
SELECT * EXCEPT (event_id, ingested_at), ingested_at FROM gateway_requests_v1 FINAL;

DROP TABLE IF EXISTS gateway_requests_v1;

-- vLLM samples: counter increases by 0.1's own delta rules (vllm_counter_deltas), gauges as they were.
-- if: SELECT (SELECT count() FROM system.tables WHERE database = currentDatabase() AND name = 'vllm_metric_samples') > 0 AND (SELECT count() FROM vllm_metrics) = 0
INSERT INTO vllm_metrics (ts, pod, engine, model_name, name, label, value, increase)
SELECT ts, pod, engine, labels['model_name'], scraped_name, le, value, delta
FROM vllm_counter_deltas(since = '1970-01-01 00:00:00', until = '2200-01-01 00:00:00', pod = '',
                         counters = ['vllm:prefix_cache_queries_total', 'vllm:prefix_cache_hits_total',
                                     'vllm:prompt_tokens_total', 'vllm:generation_tokens_total',
                                     'vllm:time_to_first_token_seconds_bucket',
                                     'vllm:request_queue_time_seconds_bucket'])
WHERE delta != 0
UNION ALL
SELECT ts, pod, engine, model_name, name, '', value, 0
FROM vllm_metric_samples
WHERE name IN ('vllm:kv_cache_usage_perc', 'vllm:gpu_cache_usage_perc', 'vllm:num_requests_running',
               'vllm:num_requests_waiting');

-- if: SELECT (SELECT count() FROM system.tables WHERE database = currentDatabase() AND name = 'vllm_metric_samples') > 0 AND (SELECT count() FROM vllm_cache_config) = 0
INSERT INTO vllm_cache_config (ts, pod, engine, labels)
SELECT ts, pod, engine, labels FROM vllm_metric_samples WHERE name = 'vllm:cache_config_info';

DROP VIEW IF EXISTS vllm_counter_deltas;

DROP TABLE IF EXISTS vllm_metric_samples;
