//! The inbox: the messages a consumer gave up on (its dead letters).

use crate::Dialect;
use crate::render::{render, upsert};

/// The inbox's statements for one server flavour.
#[derive(Debug)]
pub struct Inbox {
    /// Binds consumer, message_id, subject, payload, error, deliveries.
    pub record_dead_letter: String,
}

impl Inbox {
    pub(crate) fn new(backend: Dialect) -> Self {
        let r = |template: &str| render(backend, template);
        Self {
            record_dead_letter: r(&upsert(
                backend,
                "INSERT INTO {dead_letters} \
            (consumer, message_id, subject, payload, error, deliveries, created_at_ms) \
            VALUES (?, ?, ?, ?, ?, ?, {now})",
                "consumer, message_id",
                &["error", "deliveries"],
            )),
        }
    }
}
