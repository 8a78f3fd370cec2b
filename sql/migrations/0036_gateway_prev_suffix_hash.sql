-- prev_suffix_hash (docs/gateway-log.md): the previous turn's final message as this request carries it in its
-- history, hashed like suffix_hash. prev_history_hash proves the history before that message unchanged; this proves
-- the message itself, so a client that edited or redacted its previous message is told from a conversation that
-- continued (prefix_drift / history_changed, docs/miss-causes.md) instead of reading the tokens vLLM could not hit
-- as evicted. '' when there is no such message, the writer does not log it, and for rows stored before this
-- migration: attribution then reads the history as continued, as before.
ALTER TABLE gateway_requests
    ADD COLUMN IF NOT EXISTS prev_suffix_hash String DEFAULT '' AFTER prev_history_hash;
