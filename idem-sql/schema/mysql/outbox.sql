-- idem's outbox tables (idem_outbox, idem_outbox_heads, idem_dead_letters): the outbox and its relay, and the inbox's dead letters.

CREATE TABLE IF NOT EXISTS idem_outbox (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(36) NOT NULL, topic VARCHAR(255) NOT NULL, aggregate_key VARCHAR(255) NULL, aggregate_seq BIGINT NULL, headers TEXT NULL, payload LONGBLOB NOT NULL, state SMALLINT NOT NULL, attempts INT NOT NULL, last_error TEXT NULL, next_attempt_at_ms BIGINT NOT NULL, locked_until_ms BIGINT NOT NULL, locked_by BIGINT NOT NULL, created_at_ms BIGINT NOT NULL, published_at_ms BIGINT NULL, INDEX idem_outbox_pending (state, id), INDEX idem_outbox_aggregate (aggregate_key, id), INDEX idem_outbox_published (state, published_at_ms)) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS idem_outbox_heads (aggregate_key VARCHAR(255) NOT NULL PRIMARY KEY, last_seq BIGINT NOT NULL) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS idem_dead_letters (consumer VARCHAR(255) NOT NULL, message_id VARCHAR(255) NOT NULL, subject VARCHAR(255) NOT NULL, payload LONGBLOB NOT NULL, error TEXT NOT NULL, deliveries BIGINT NOT NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (consumer, message_id)) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
