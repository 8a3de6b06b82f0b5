-- `idem schema --backend sqlite --only ledger`: the table idem records publications in.
-- idem's ledger tables (idem_ledger): every #[idempotent] call (atomic and lease mode).

CREATE TABLE IF NOT EXISTS idem_ledger (id BLOB NOT NULL PRIMARY KEY, scope TEXT NOT NULL, principal TEXT NOT NULL, idem_key TEXT NOT NULL, owner INTEGER NOT NULL, fingerprint BLOB NOT NULL, state INTEGER NOT NULL, response BLOB NULL, created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL) WITHOUT ROWID;

DROP INDEX IF EXISTS idem_ledger_expires;
