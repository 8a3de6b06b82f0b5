-- idem's completer tables (idem_calls): resumable lease-mode calls and their completer (`resumable`).

CREATE TABLE IF NOT EXISTS idem_calls (record_id BYTEA NOT NULL PRIMARY KEY, scope VARCHAR(255) NOT NULL, args BYTEA NOT NULL, ttl_ms BIGINT NOT NULL, attempts INTEGER NOT NULL, next_attempt_at_ms BIGINT NOT NULL, last_error TEXT NULL, gave_up SMALLINT NOT NULL, final_phase_done SMALLINT NOT NULL, created_at_ms BIGINT NOT NULL);
