//! The inbox: the messages a consumer gave up on (its dead letters).

use crate::statement::render::{render, upsert};
use crate::{Bound, Dialect};

/// The inbox's statements for one server flavour.
#[derive(Debug)]
pub struct Inbox {
    /// Binds consumer, message_id, subject, payload, error, deliveries.
    pub(crate) record_dead_letter: String,
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

/// A message a consumer gave up on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewDeadLetter {
    /// The consumer that gave up.
    pub consumer: String,
    /// The message's id.
    pub message_id: String,
    /// Its subject (topic).
    pub subject: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The last error.
    pub error: String,
    /// Deliveries made.
    pub deliveries: i64,
}

impl Inbox {
    /// Records `letter` (over an earlier one of the same consumer and message).
    pub fn record_dead_letter(&self, letter: &NewDeadLetter) -> Bound<'_> {
        Bound::new(
            &self.record_dead_letter,
            [
                letter.consumer.as_str().into(),
                letter.message_id.as_str().into(),
                letter.subject.as_str().into(),
                letter.payload.as_slice().into(),
                letter.error.as_str().into(),
                letter.deliveries.into(),
            ],
        )
    }
}
