-- key_stage.order_key: scratch sets of order_keys (sql/migrations/0008: ts in ms << 20 | 20 bits of the request
-- id's MD5), so that the attribution job reads a chunk's older predecessors by the integer that names them in its
-- predecessor search (with cityHash64 of the id), not by their request ids, which that search no longer carries.
-- Binding them as an Array parameter is not linear in their number (10^4 in 0.03 s, 5·10^5 over 100 s in chDB).
-- Memory engine: nothing to keep; rows staged by (request_id, ts) leave it 0.
ALTER TABLE key_stage ADD COLUMN IF NOT EXISTS order_key UInt64 DEFAULT 0;
