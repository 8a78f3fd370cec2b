-- vllm_counter_deltas: how much each vLLM counter (a *_total counter or a histogram's *_bucket count) grew
-- between consecutive scrapes. One row per sample with ts in [since, until) that has a predecessor in its
-- series. The one definition of the counter rules, which hit_rate, hit_rate_total, pods, tokens and latency
-- each used to repeat:
-- * a series is (scraped name, pod, engine, labels), its delta taken between consecutive samples (lagInFrame
--   over ts). A drop of the value, or a change of the counter's *_created sample, is a restart: the delta
--   is then the new value. A series without *_created samples (histogram buckets) restarts on a drop only.
-- * the first sample of a series contributes no delta. Samples are read from one day before `since`, so the
--   first sample in the window has its baseline.
-- * older vLLM (<= 0.11) exposes vllm:gpu_prefix_cache_* and 0.10 exposes both generations with equal
--   values: asking for vllm:prefix_cache_* reads both, and at each scrape of a (pod, engine) the older names
--   are used only when the newer ones of the family are absent (never both: no double count). `name` is the
--   newer name either way, `scraped_name` the one the delta came from. `le` is a histogram bucket's bound
--   label ('' on plain counters): selecting it rather than `labels` spares carrying the map through the sort.
-- * duplicate samples (a re-sent scrape not yet merged) repeat a value and add a zero delta, so no FINAL.
--
-- Parameterized view (ClickHouse >= 23.1), called with every parameter:
--   FROM vllm_counter_deltas(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')},
--                            pod = {pod:String}, counters = ['vllm:prompt_tokens_total'])
-- pod '' = all pods. counters = the newer names wanted: one view serves every counter family, and each
-- query reads only the series it needs (name IN (SELECT ...) still uses the primary key's name prefix).
-- A plain view, no engine or ORDER BY: it stores nothing, and the deltas depend on the caller's window
-- (its baseline), so they cannot be materialized once; vllm_metric_samples' ORDER BY (name, pod, engine,
-- labels, ts) already serves the read.
CREATE VIEW IF NOT EXISTS vllm_counter_deltas AS
WITH
    arrayConcat({counters:Array(String)},
                arrayMap(c -> replaceOne(c, 'vllm:prefix_cache_', 'vllm:gpu_prefix_cache_'),
                         arrayFilter(c -> startsWith(c, 'vllm:prefix_cache_'), {counters:Array(String)})))
        AS scraped_names,
    arrayMap(c -> replaceRegexpOne(c, '_total$', '_created'), arrayFilter(c -> endsWith(c, '_total'), scraped_names))
        AS created_names,
    newer_scrapes AS
    (
        -- scrapes of a (pod, engine) that expose a newer-generation prefix-cache counter asked for. vLLM renamed
        -- hits and queries together, so either one present makes both older names redundant at that scrape.
        SELECT DISTINCT pod, engine, ts
        FROM vllm_metric_samples
        WHERE name IN (SELECT arrayJoin(arrayFilter(c -> startsWith(c, 'vllm:prefix_cache_'), scraped_names)))
          AND ts >= {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY
          AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
    ),
    counters AS
    (
        SELECT
            name AS scraped_name,
            replaceOne(name, 'vllm:gpu_prefix_cache_', 'vllm:prefix_cache_') AS counter_name,
            pod,
            engine,
            labels,
            labels['le'] AS le,
            toString(mapSort(labels)) AS series_labels,
            ts,
            value,
            if(endsWith(name, '_total'), replaceRegexpOne(name, '_total$', '_created'), '') AS created_name
        FROM vllm_metric_samples
        WHERE name IN (SELECT arrayJoin(scraped_names))
          AND ts >= {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY
          AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
          -- an anti-join, not a window over each scrape: that window costs a sort of every row read
          AND (NOT startsWith(name, 'vllm:gpu_prefix_cache_')
               OR (pod, engine, ts) NOT IN (SELECT pod, engine, ts FROM newer_scrapes))
    ),
    created AS
    (
        SELECT name AS created_name, pod, engine, toString(mapSort(labels)) AS series_labels, ts,
               max(value) AS created
        FROM vllm_metric_samples
        WHERE name IN (SELECT arrayJoin(created_names))
          AND ts >= {since:DateTime64(3, 'UTC')} - INTERVAL 1 DAY
          AND ts < {until:DateTime64(3, 'UTC')}
          AND ({pod:String} = '' OR pod = {pod:String})
        GROUP BY created_name, pod, engine, series_labels, ts
    ),
    samples AS
    (
        -- *_total counters, each with its _created sample of the same scrape (0 where there is none)
        SELECT c.scraped_name AS scraped_name, c.counter_name AS counter_name, c.pod AS pod, c.engine AS engine,
               c.labels AS labels, c.le AS le, c.series_labels AS series_labels, c.ts AS ts, c.value AS value,
               cr.created AS created
        FROM counters AS c
        LEFT JOIN created AS cr
            ON c.created_name = cr.created_name AND c.pod = cr.pod AND c.engine = cr.engine
           AND c.series_labels = cr.series_labels AND c.ts = cr.ts
        WHERE c.created_name != ''
        UNION ALL
        -- histogram buckets have no _created of their own: they skip the join (the costliest step on them)
        SELECT scraped_name, counter_name, pod, engine, labels, le, series_labels, ts, value, 0 AS created
        FROM counters
        WHERE created_name = ''
    ),
    deltas AS
    (
        SELECT
            ts,
            pod,
            engine,
            counter_name,
            scraped_name,
            labels,
            le,
            value,
            row_number() OVER w = 1 AS is_first,
            if(value < lagInFrame(value) OVER w
                   OR (created > 0 AND lagInFrame(created) OVER w > 0 AND created != lagInFrame(created) OVER w),
               value,
               value - lagInFrame(value) OVER w) AS delta
        FROM samples
        WINDOW w AS (PARTITION BY scraped_name, pod, engine, series_labels ORDER BY ts
                     ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
    )
SELECT ts, pod, engine, counter_name AS name, scraped_name, labels, le, value, delta
FROM deltas
WHERE ts >= {since:DateTime64(3, 'UTC')} AND NOT is_first
