-- pods_down (docs/gateway-log.md): the other pods the gateway found down when it routed the request (refused its
-- connection, or marked down after refusing an earlier one). A prefix held on one of them could not have been
-- reached, so its missed tokens read `routed_away / pod_down` (docs/miss-causes.md): the pod's outage, not the
-- router, lost the hit. Empty for rows stored before this migration and for gateways that do not log it.
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS pods_down Array(LowCardinality(String)) DEFAULT [] AFTER routing_reason;
