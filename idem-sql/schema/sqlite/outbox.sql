-- idem's outbox tables (idem_outbox, idem_outbox_heads, idem_dead_letters): the outbox and its relay, and the inbox's dead letters.

CREATE TABLE IF NOT EXISTS idem_outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL, topic TEXT NOT NULL, aggregate_key TEXT NULL, aggregate_seq INTEGER NULL, headers TEXT NULL, payload BLOB NOT NULL, state INTEGER NOT NULL, attempts INTEGER NOT NULL, last_error TEXT NULL, next_attempt_at_ms INTEGER NOT NULL, locked_until_ms INTEGER NOT NULL, locked_by INTEGER NOT NULL, created_at_ms INTEGER NOT NULL, published_at_ms INTEGER NULL);

CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (id) WHERE state = 0;

CREATE INDEX IF NOT EXISTS idem_outbox_aggregate ON idem_outbox (aggregate_key, id) WHERE state <> 1;

CREATE INDEX IF NOT EXISTS idem_outbox_published ON idem_outbox (published_at_ms) WHERE state = 1;

CREATE INDEX IF NOT EXISTS idem_outbox_dead ON idem_outbox (id) WHERE state = 2;

CREATE TABLE IF NOT EXISTS idem_outbox_heads (aggregate_key TEXT NOT NULL PRIMARY KEY, last_seq INTEGER NOT NULL) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS idem_dead_letters (consumer TEXT NOT NULL, message_id TEXT NOT NULL, subject TEXT NOT NULL, payload BLOB NOT NULL, error TEXT NOT NULL, deliveries INTEGER NOT NULL, created_at_ms INTEGER NOT NULL, PRIMARY KEY (consumer, message_id)) WITHOUT ROWID;
