-- idem's lease tables (idem_steps): lease mode's recorded steps (`lease = ...`).

CREATE TABLE IF NOT EXISTS idem_steps (record_id BLOB NOT NULL, name TEXT NOT NULL, token INTEGER NOT NULL, result BLOB NOT NULL, created_at_ms INTEGER NOT NULL, PRIMARY KEY (record_id, name)) WITHOUT ROWID;
