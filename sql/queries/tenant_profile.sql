-- name: tenant_profile
-- description: Per tenant, the workload traits that decide whether prefix-cache work pays: prompt size, the stable prefix (everything before the new suffix), how often each stable prefix repeats, the hit rate, and TTFT.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: tenant_id String | tenant
-- returns: requests UInt64 | served requests (status < 400, prompt_tokens > 0)
-- returns: prompt_tokens UInt64 | Σ prompt tokens of served requests, tokens
-- returns: prefix_tokens UInt64 | Σ (prompt − suffix) tokens of served requests: the part a cache could reuse, tokens
-- returns: mean_prompt_tokens Float64 | prompt_tokens / requests, tokens per request
-- returns: mean_prefix_tokens Float64 | prefix_tokens / requests, tokens per request
-- returns: prefix_share Float64 | prefix_tokens / prompt_tokens, fraction 0..1
-- returns: prompt_fingerprint_cardinality UInt64 | distinct stable-prefix fingerprints (uniqCombined: exact below ~65k)
-- returns: requests_per_fingerprint Nullable(Float64) | requests / prompt_fingerprint_cardinality: how often a stable prefix repeats (NULL without fingerprints)
-- returns: requests_with_predecessor UInt64 | served requests with a predecessor sharing their prefix (previous turn, or the same prompt_fingerprint; docs/miss-causes.md)
-- returns: reuse_share Float64 | requests_with_predecessor / requests: the share of requests a cache could serve from an earlier one, fraction 0..1
-- returns: token_weighted_hit_rate Nullable(Float64) | Σ cached / Σ prompt tokens of the requests whose cached count is known, fraction 0..1
-- returns: ttft_p95_ms Nullable(Float64) | gateway TTFT p95 (t-digest) over the served requests (as requests; migration 0048), ms
--
-- Reads requests_rollup and affinity_rollup (sql/migrations/0012, 0014; the latter sign-weighted). The verdict built on it is in docs/fix-first.md ("Does
-- cache work pay?").
WITH
    reuse AS
    (
        SELECT CAST(tenant_id AS String) AS tenant, toUInt64(greatest(sum(with_predecessor), 0)) AS with_pred
        FROM affinity_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
        WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
        GROUP BY tenant
    ),
    traffic AS
    (
        SELECT
            CAST(tenant_id AS String) AS tenant,
            sum(served) AS served_sum,
            sum(prompt_tokens) AS prompt_sum,
            sum(r.prefix_tokens) AS prefix_sum,
            uniqCombinedMerge(fingerprints) AS cardinality,
            if(sum(known_prompt_tokens) > 0, sum(cached_tokens) / sum(known_prompt_tokens), NULL) AS hit_rate,
            CAST(quantilesTDigestMerge(0.5, 0.95, 0.99)(ttft_ms)[2] AS Nullable(Float64)) AS ttft_p95
        FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1) AS r
        WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
        GROUP BY tenant
        HAVING served_sum > 0
    )
SELECT
    t.tenant AS tenant_id,
    t.served_sum AS requests,
    t.prompt_sum AS prompt_tokens,
    t.prefix_sum AS prefix_tokens,
    t.prompt_sum / t.served_sum AS mean_prompt_tokens,
    t.prefix_sum / t.served_sum AS mean_prefix_tokens,
    if(t.prompt_sum > 0, t.prefix_sum / t.prompt_sum, 0) AS prefix_share,
    t.cardinality AS prompt_fingerprint_cardinality,
    if(t.cardinality > 0, t.served_sum / t.cardinality, NULL) AS requests_per_fingerprint,
    least(ifNull(u.with_pred, 0), t.served_sum) AS requests_with_predecessor,
    requests_with_predecessor / t.served_sum AS reuse_share,
    t.hit_rate AS token_weighted_hit_rate,
    t.ttft_p95 AS ttft_p95_ms
FROM traffic AS t
LEFT JOIN reuse AS u ON t.tenant = u.tenant
ORDER BY prompt_tokens DESC, tenant_id
