-- next_history_hash (docs/gateway-log.md): this request's history and final message hashed as one history. A next
-- request that re-sends them with no reply in between (a message sent before the reply came, user-only turns)
-- carries it as its history_prefix_hash, so attribution reads that turn as continued instead of as a truncated
-- history (prev_history_hash assumes a reply between the two turns). '' when the writer does not log it, for
-- /v1/completions, and for rows stored before this migration: attribution then reads the history as before.
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS next_history_hash String DEFAULT '' AFTER prev_suffix_hash;
