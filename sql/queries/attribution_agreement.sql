-- name: attribution_agreement
-- description: How often miss-cause attribution names the cause a labelled workload was built to show: per cause (and sub-cause) the labelled requests, those attributed to it and those that match, with precision, recall and a micro total row; with confusion = 1, the intended × attributed counts.
-- param: since: DateTime64(3, 'UTC') = 1970-01-01 00:00:00 | start of the window (inclusive, on the label's ts: when the request was sent), UTC
-- param: until: DateTime64(3, 'UTC') = 2200-01-01 00:00:00 | end of the window (exclusive), UTC
-- param: tenant: String = '' | tenant_id to keep, '' = all
-- param: run_id: String = '' | the labelled run to keep (workload_labels.run_id), '' = all runs
-- param: scenario: String = '' | the scenario to keep (workload_labels.scenario, e.g. tools_reordered), '' = all
-- param: by_sub_cause: UInt8 = 1 | 1 = a class is (cause, sub_cause): prefix_drift / volatile_system and prefix_drift / tools_reordered differ; 0 = a class is a cause (sub-causes '' and their tokens pooled)
-- param: confusion: UInt8 = 0 | 0 = one row per class and the micro total row; 1 = one row per (intended, attributed) pair that occurs
-- returns: intended_cause String | the label's class: none (nothing avoidable should miss) or a miss cause; 'all' on the micro total row
-- returns: intended_sub_cause String | the label's sub_cause ('' when by_sub_cause = 0 and on the total row)
-- returns: attributed_cause String | the attribution's dominant cause (see below); with confusion = 0 the same class as intended_cause
-- returns: attributed_sub_cause String | the dominant cause's sub_cause ('' when by_sub_cause = 0)
-- returns: requests UInt64 | evaluated requests labelled intended_* and attributed attributed_* (confusion = 0: the matches of the class; total row: all matches), requests
-- returns: labelled UInt64 | evaluated requests labelled intended_* (recall's denominator; total row: summed over classes but none), requests
-- returns: attributed UInt64 | evaluated requests whose dominant cause is attributed_* (precision's denominator; total row: summed over classes but none), requests
-- returns: precision Nullable(Float64) | requests / attributed, fraction 0..1 (total row: micro precision); NULL when attributed = 0
-- returns: recall Nullable(Float64) | requests / labelled, fraction 0..1 (total row: micro recall); NULL when labelled = 0
-- returns: tokens_checked UInt64 | of the requests labelled intended_* (confusion = 1: of this row's requests), those whose label gives an expected token split, requests
-- returns: tokens_exact UInt64 | of tokens_checked, those whose current answer splits the missed tokens exactly so: the same (cause, sub_cause, tokens) entries, unavoidable included, requests
--
-- Definitions (docs/miss-causes.md, "Validating attribution"):
-- * A request is (request_id, ts), as the store keys it; a label goes with the request of its request_id nearest
--   its ts (ids can repeat across runs).
-- * Evaluated requests: labels in the window and filters (workload_labels, one per (request_id, ts): two
--   labelled runs reusing ids are two labelled requests) whose request the gateway served (gateway_requests:
--   status < 400, prompt_tokens > 0) and the attribution answered (a current row in request_attribution).
--   Others (failed, not logged, not attributed yet) are left out.
-- * Dominant cause of a request: over its current answer's missed tokens (sign-weighted, so a replaced answer
--   counts no more), summed per class, unavoidable left out, the class with the most tokens; a tie goes to
--   the class first in (cause, sub_cause) alphabetical order. 'none' when nothing but unavoidable missed.
-- * Per class c: requests (matched) = labelled c and dominant c; precision = matched / attributed c;
--   recall = matched / labelled c. Total row ('all'): micro averages over every class but none (the negative
--   class: nothing to find), Σ matched / Σ attributed and Σ matched / Σ labelled.
-- Labels' ts is the sender's clock (or the gateway's arrival ts): the gateway and attribution rows are read
-- within an hour of the labels' range, so only those partitions are scanned.
-- Each table is read once: ClickHouse runs a WITH subquery again wherever it is named, so each request's answer
-- (its split and dominant class) comes from one GROUP BY with sumMap, the classes from one ARRAY JOIN over the
-- cells, and the confusion rows' totals from window functions over the same cells.
WITH
    labels AS
    (
        SELECT request_id, ts, CAST(cause AS String) AS l_cause,
               if({by_sub_cause:UInt8} = 1, CAST(sub_cause AS String), '') AS l_sub,
               arraySort(arrayZip(CAST(expected_causes AS Array(String)), CAST(expected_sub_causes AS Array(String)),
                                  expected_tokens)) AS expected
        FROM workload_labels
        WHERE ts >= {since:DateTime64(3, 'UTC')} AND ts < {until:DateTime64(3, 'UTC')}
          AND ({tenant:String} = '' OR tenant_id = {tenant:String})
          AND ({run_id:String} = '' OR run_id = {run_id:String})
          AND ({scenario:String} = '' OR scenario = {scenario:String})
        -- one label per labelled request (request_id, ts): two runs reusing ids keep a label each
        LIMIT 1 BY request_id, ts
    ),
    (SELECT min(ts) - INTERVAL 1 HOUR FROM labels) AS lo,
    (SELECT max(ts) + INTERVAL 1 HOUR FROM labels) AS hi,
    answers AS
    (
        -- per answered request (request_id, ts: ids can repeat across runs): its missed tokens per
        -- (cause, sub_cause), sign-weighted, those above 0
        SELECT request_id, ts,
               arrayFilter(x -> x.3 > 0, arrayMap((k, v) -> (k.1, k.2, v), m.1, m.2)) AS entries
        FROM
        (
            SELECT request_id, ts,
                   sumMap(arrayMap((c, sc) -> (CAST(c AS String), CAST(sc AS String)), causes, sub_causes),
                          arrayMap(n -> toInt64(n) * sign, missed_tokens)) AS m
            FROM request_attribution
            WHERE ts >= lo AND ts <= hi AND request_id IN (SELECT request_id FROM labels)
              AND (request_id, ts) IN (SELECT request_id, ts FROM gateway_requests
                                       WHERE ts >= lo AND ts <= hi AND status < 400 AND prompt_tokens > 0)
            GROUP BY request_id, ts
            HAVING sum(sign) > 0
        )
    ),
    evaluated AS
    (
        SELECT l.l_cause AS i_cause, l.l_sub AS i_sub,
               arrayMap(e -> (e.1, if({by_sub_cause:UInt8} = 1, e.2, ''), e.3),
                        arrayFilter(e -> e.1 != 'unavoidable', a.entries)) AS classed,
               -- the dominant class: the most tokens (sub-causes pooled when by_sub_cause = 0), then name order
               arraySort(x -> (-x.3, x.1, x.2),
                         arrayMap(k -> (k.1, k.2, arraySum(arrayMap(e -> if((e.1, e.2) = k, e.3, 0), classed))),
                                  arrayDistinct(arrayMap(e -> (e.1, e.2), classed))))[1] AS top,
               if(top.1 = '', 'none', top.1) AS a_cause, top.2 AS a_sub,
               length(l.expected) > 0 AS checked,
               checked AND l.expected = arraySort(arrayMap(e -> (e.1, e.2, toUInt32(e.3)), a.entries)) AS exact
        FROM labels AS l
        INNER JOIN answers AS a ON a.request_id = l.request_id
        -- a reused request_id: the label goes with the answer of the request nearest its ts
        ORDER BY abs(toUnixTimestamp64Milli(a.ts) - toUnixTimestamp64Milli(l.ts))
        LIMIT 1 BY l.request_id, l.ts
    ),
    cells AS
    (
        SELECT i_cause, i_sub, a_cause, a_sub, count() AS n, countIf(checked) AS n_checked, countIf(exact) AS n_exact
        FROM evaluated
        GROUP BY i_cause, i_sub, a_cause, a_sub
    )
SELECT intended_cause, intended_sub_cause, attributed_cause, attributed_sub_cause, requests, labelled, attributed,
       if(attributed > 0, requests / attributed, NULL) AS precision,
       if(labelled > 0, requests / labelled, NULL) AS recall,
       tokens_checked, tokens_exact
FROM
(
    -- confusion = 0: per class, and the micro total row over every class but none (GROUPING SETS' empty set)
    SELECT if(total_row, 'all', x.1) AS intended_cause, if(total_row, '', x.2) AS intended_sub_cause,
           intended_cause AS attributed_cause, intended_sub_cause AS attributed_sub_cause,
           toUInt64(if(total_row, sumIf(x.5, x.1 != 'none'), sum(x.5))) AS requests,
           toUInt64(if(total_row, sumIf(x.3, x.1 != 'none'), sum(x.3))) AS labelled,
           toUInt64(if(total_row, sumIf(x.4, x.1 != 'none'), sum(x.4))) AS attributed,
           toUInt64(if(total_row, sumIf(x.6, x.1 != 'none'), sum(x.6))) AS tokens_checked,
           toUInt64(if(total_row, sumIf(x.7, x.1 != 'none'), sum(x.7))) AS tokens_exact,
           toUInt8(grouping(x.1, x.2) != 0) AS total_row
    FROM cells
    ARRAY JOIN [(i_cause, i_sub, n, toUInt64(0), if(i_cause = a_cause AND i_sub = a_sub, n, 0), n_checked, n_exact),
                (a_cause, a_sub, toUInt64(0), n, toUInt64(0), toUInt64(0), toUInt64(0))] AS x
    WHERE {confusion:UInt8} = 0
    GROUP BY GROUPING SETS ((x.1, x.2), ())
    HAVING NOT total_row OR countIf(x.1 != 'none') > 0
    UNION ALL
    SELECT i_cause, i_sub, a_cause, a_sub, toUInt64(n), toUInt64(sum(n) OVER (PARTITION BY i_cause, i_sub)),
           toUInt64(sum(n) OVER (PARTITION BY a_cause, a_sub)), toUInt64(n_checked), toUInt64(n_exact), 0
    FROM cells
    WHERE {confusion:UInt8} = 1
)
ORDER BY total_row, intended_cause, intended_sub_cause, attributed_cause, attributed_sub_cause
