-- name: pod_affinity
-- description: Per pod: cache affinity of the requests it served (of those with a prefix-sharing predecessor, the token-weighted share whose predecessor ran on this pod too), tenants pooled; tenant_affinity per pod, in one query.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod that served the request, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- returns: pod String | pod that served the requests
-- returns: requests_with_predecessor UInt64 | requests it served that have a predecessor sharing their prefix (previous turn, or the same prompt_fingerprint)
-- returns: predecessor_tokens UInt64 | Σ prompt tokens of those requests, tokens
-- returns: same_pod_tokens UInt64 | Σ prompt tokens of those whose predecessor this pod served too, tokens
-- returns: cache_affinity Nullable(Float64) | same_pod_tokens / predecessor_tokens, fraction 0..1; NULL when no request has a predecessor
--
-- Reads affinity_rollup (sql/migrations/0012), sign-weighted, exact: per pod, the sums tenant_affinity takes per
-- tenant (its `pod` filter), so Σ over tenant_affinity's rows with pod = P gives this query's row for P.
SELECT
    CAST(pod AS String) AS pod,
    toUInt64(greatest(sum(with_predecessor), 0)) AS requests_with_predecessor,
    toUInt64(greatest(sum(predecessor_tokens), 0)) AS predecessor_tokens,
    toUInt64(greatest(sum(same_pod_tokens), 0)) AS same_pod_tokens,
    if(predecessor_tokens > 0, same_pod_tokens / predecessor_tokens, NULL) AS cache_affinity
FROM affinity_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = 1)
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
GROUP BY pod
HAVING sum(answered) > 0
ORDER BY pod
