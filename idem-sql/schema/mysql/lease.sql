-- idem's lease tables (idem_steps): lease mode's recorded steps (`lease = ...`).

CREATE TABLE IF NOT EXISTS idem_steps (record_id BINARY(32) NOT NULL, name VARCHAR(255) NOT NULL, token BIGINT NOT NULL, result LONGBLOB NOT NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (record_id, name)) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
