//! The names idem's tables, indexes, savepoint and wake-up channel go by, each spelled once.

/// Name of the ledger table.
pub const LEDGER_TABLE: &str = "idem_ledger";
/// Name of the table of recorded steps (recovery points) of calls in progress.
pub const STEPS_TABLE: &str = "idem_steps";
/// Name of the table of resumable calls in progress: their stored arguments, and their
/// completer attempts.
pub const CALLS_TABLE: &str = "idem_calls";
/// Name of the outbox table.
pub const OUTBOX_TABLE: &str = "idem_outbox";
/// Name of the table holding each aggregate's last sequence number.
pub const OUTBOX_HEADS_TABLE: &str = "idem_outbox_heads";
/// Name of the table of messages a consumer gave up on.
pub const DEAD_LETTERS_TABLE: &str = "idem_dead_letters";

/// Every table idem creates, in the order `create_tables` creates them.
pub const ALL_TABLES: [&str; 6] = [
    LEDGER_TABLE,
    STEPS_TABLE,
    CALLS_TABLE,
    OUTBOX_TABLE,
    OUTBOX_HEADS_TABLE,
    DEAD_LETTERS_TABLE,
];

/// The savepoint a claim takes before the handler's body runs.
pub(crate) const CLAIM_SAVEPOINT: &str = "idem_claim";
/// The PostgreSQL channel a staged message notifies relays on: the outbox's name.
pub const WAKE_CHANNEL: &str = OUTBOX_TABLE;

/// The `state` column of the outbox.
pub mod outbox_state {
    /// Waiting for the relay.
    pub const PENDING: i16 = 0;
    /// Published (the broker confirmed it).
    pub const PUBLISHED: i16 = 1;
    /// Given up on: the broker refused it, or its attempts ran out.
    pub const DEAD: i16 = 2;
}
