-- idem's ledger tables (idem_ledger): every #[idempotent] call (atomic and lease mode).

CREATE TABLE IF NOT EXISTS idem_ledger (id BYTEA NOT NULL PRIMARY KEY, scope VARCHAR(255) NOT NULL, principal VARCHAR(255) NOT NULL, idem_key VARCHAR(255) NOT NULL, owner BIGINT NOT NULL, fingerprint BYTEA NOT NULL, state SMALLINT NOT NULL, response BYTEA NULL, created_at_ms BIGINT NOT NULL, expires_at_ms BIGINT NOT NULL) WITH (fillfactor = 90);

CREATE INDEX IF NOT EXISTS idem_ledger_expires ON idem_ledger (expires_at_ms);
