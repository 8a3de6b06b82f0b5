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

/// Where a consumer records the messages it gave up on: the dead-letter table
/// ([`DEAD_LETTERS_TABLE`](crate::DEAD_LETTERS_TABLE)) on driver `D`'s pool, written once for
/// every driver.
#[derive(Debug, Clone)]
pub struct DeadLetterTable<D> {
    store: crate::SqlStore<D>,
}

impl<D: crate::Driver> DeadLetterTable<D> {
    /// The dead-letter table on `pool` (a `DatabaseConnection`, a sqlx `Pool`, ...; the
    /// store's `create_tables` creates it).
    pub fn new(pool: impl Into<D>) -> Self {
        Self {
            store: crate::SqlStore::new(pool),
        }
    }
}

impl<D: crate::Driver> idem_core::outbox::DeadLetters for DeadLetterTable<D> {
    async fn record(
        &self,
        letter: &idem_core::outbox::DeadLetter<'_>,
    ) -> Result<(), idem_core::Error> {
        let record = self
            .store
            .statements()
            .inbox
            .record_dead_letter(&NewDeadLetter {
                consumer: letter.consumer.to_owned(),
                message_id: letter.message_id.to_owned(),
                subject: letter.subject.to_owned(),
                payload: letter.payload.to_vec(),
                // Bounded: an error text can be long; the start says what failed.
                error: letter.error.chars().take(2000).collect(),
                deliveries: i64::try_from(letter.deliveries).unwrap_or(i64::MAX),
            });
        let store = self.store.clone();
        // Detached: a consumer that stops waiting still leaves the letter recorded.
        idem_core::detached(async move {
            let doing = "recording a dead letter";
            let mut conn = store.pooled(doing).await?;
            crate::Connection::execute(&mut conn, record)
                .await
                .map(drop)
                .map_err(|e| crate::driver::db_error::<D>(doing, e))
        })
        .await
    }
}
