-- name: fingerprint_cardinality
-- description: prompt_fingerprint_cardinality per tenant per bucket (distinct stable-prefix fingerprints; a jump means something volatile entered the prefix) and the same per segment, raw beside its normalized variant (raw > normalized = volatile values, reordered tools or RAG).
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the request's arrival; the rollups hold whole minutes: a since inside a minute counts from the minute's start), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive; an until inside a minute counts to the minute's end: whole minutes, as since), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: pod: String = '' | pod to keep, '' = all
-- param: model: String = '' | model to keep ('' = all): the gateway log's `model`, vLLM's `model_name` label
-- param: bucket_seconds: UInt32 = 60 | bucket width, seconds: a positive multiple of 60 (the rollups hold whole minutes)
-- param: by_tenant: UInt8 = 1 | 1 = one row per tenant and bucket; 0 = tenants pooled (tenant_id '')
-- returns: bucket DateTime64(3, 'UTC') | bucket start, UTC
-- returns: tenant_id String | tenant, or '' when by_tenant = 0
-- returns: requests UInt64 | requests logged by the gateway (all statuses: the prompt was assembled either way)
-- returns: prompt_fingerprint_cardinality UInt64 | distinct non-empty prompt_fingerprint values
-- returns: system_hash_cardinality UInt64 | distinct non-empty system_hash (raw system prompt)
-- returns: system_norm_hash_cardinality UInt64 | distinct non-empty system_norm_hash (volatile values masked)
-- returns: tools_hash_cardinality UInt64 | distinct non-empty tools_hash (tool schemas as sent)
-- returns: tools_canonical_hash_cardinality UInt64 | distinct non-empty tools_canonical_hash (JSON keys sorted)
-- returns: retrieval_pack_hash_cardinality UInt64 | distinct non-empty retrieval_pack_hash (documents in prompt order)
-- returns: retrieval_set_hash_cardinality UInt64 | distinct non-empty retrieval_set_hash (documents as a set)
--
-- Reads requests_rollup's uniqCombined states (sql/migrations/0012): exact below ~65k distinct values per row
-- group, HyperLogLog (≈ 1 % error) above.
SELECT bucket, tenant AS tenant_id, request_count AS requests, prompt_fingerprint_cardinality,
       system_hash_cardinality, system_norm_hash_cardinality, tools_hash_cardinality,
       tools_canonical_hash_cardinality, retrieval_pack_hash_cardinality, retrieval_set_hash_cardinality
FROM
(
    SELECT
        toDateTime64(toStartOfInterval(t, toIntervalSecond({bucket_seconds:UInt32})), 3, 'UTC') AS bucket,
        if({by_tenant:UInt8} = 1, CAST(tenant_id AS String), '') AS tenant,
        sum(requests) AS request_count,
        uniqCombinedMerge(fingerprints) AS prompt_fingerprint_cardinality,
        uniqCombinedMerge(system_hashes) AS system_hash_cardinality,
        uniqCombinedMerge(system_norm_hashes) AS system_norm_hash_cardinality,
        uniqCombinedMerge(tools_hashes) AS tools_hash_cardinality,
        uniqCombinedMerge(tools_canonical_hashes) AS tools_canonical_hash_cardinality,
        uniqCombinedMerge(retrieval_pack_hashes) AS retrieval_pack_hash_cardinality,
        uniqCombinedMerge(retrieval_set_hashes) AS retrieval_set_hash_cardinality
    FROM requests_rollup(since = {since:DateTime64(3, 'UTC')}, until = {until:DateTime64(3, 'UTC')}, hourly = toUInt8({bucket_seconds:UInt32} % 3600 = 0))
    WHERE ({tenant:String} = '' OR tenant_id = {tenant:String}) AND ({pod:String} = '' OR pod = {pod:String}) AND ({model:String} = '' OR model = {model:String})
    GROUP BY bucket, tenant
)
ORDER BY bucket, tenant_id
