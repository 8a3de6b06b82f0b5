-- idem's lease tables (idem_steps): lease mode's recorded steps (`lease = ...`).

CREATE TABLE IF NOT EXISTS idem_steps (record_id BYTEA NOT NULL, name VARCHAR(255) NOT NULL, token BIGINT NOT NULL, result BYTEA NOT NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (record_id, name));
