-- idem's completer tables (idem_calls): resumable lease-mode calls and their completer (`resumable`).

CREATE TABLE IF NOT EXISTS idem_calls (record_id BLOB NOT NULL PRIMARY KEY, scope TEXT NOT NULL, args BLOB NOT NULL, ttl_ms INTEGER NOT NULL, attempts INTEGER NOT NULL, next_attempt_at_ms INTEGER NOT NULL, last_error TEXT NULL, gave_up INTEGER NOT NULL, final_phase_done INTEGER NOT NULL, created_at_ms INTEGER NOT NULL) WITHOUT ROWID;
