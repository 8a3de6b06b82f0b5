-- idem's ledger tables (idem_ledger): every #[idempotent] call (atomic and lease mode).

CREATE TABLE IF NOT EXISTS idem_ledger (id BINARY(32) NOT NULL PRIMARY KEY, scope VARCHAR(255) NOT NULL, principal VARCHAR(255) NOT NULL, idem_key VARCHAR(255) NOT NULL, owner BIGINT NOT NULL, fingerprint BINARY(32) NOT NULL, state SMALLINT NOT NULL, response LONGBLOB NULL, created_at_ms BIGINT NOT NULL, expires_at_ms BIGINT NOT NULL, INDEX idem_ledger_expires (expires_at_ms)) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
