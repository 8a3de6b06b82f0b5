//! The relay's side of the store, once for every driver: its claim (one statement, or
//! MySQL's three in a READ COMMITTED transaction), its marks and the outbox's health, on
//! [`SqlStore`], which the [`Relay`](super::Relay) runs on.

use std::time::Duration;

use idem_core::Error;

use super::{ClaimedMessage, FailedAttempt, claim_messages, record_outcomes};
use crate::driver::{db_error, failed};
use crate::store::SqlStore;
use crate::{Begin, Driver, Transaction};

impl<D: Driver> SqlStore<D> {
    /// Claims up to `batch` due messages for `lease`, leased to `token`
    /// ([`claim_messages`]).
    pub async fn claim_messages(
        &self,
        batch: u32,
        lease: Duration,
        token: i64,
    ) -> Result<Vec<ClaimedMessage>, Error> {
        let outbox = &self.statements().outbox;
        let doing = "claiming outbox messages";
        if !outbox.claims_in_three_steps() {
            let mut conn = self.pooled(doing).await?;
            return claim_messages(&mut conn, outbox, batch, lease, token)
                .await
                .map_err(failed::<D>);
        }
        // The three statements' transaction reads rows committed since it began.
        let mut tx = self
            .driver()
            .begin(Begin::ReadCommitted)
            .await
            .map_err(|e| db_error::<D>(doing, e))?;
        let claimed = claim_messages(&mut tx, outbox, batch, lease, token)
            .await
            .map_err(failed::<D>)?;
        tx.commit().await.map_err(|e| db_error::<D>(doing, e))?;
        Ok(claimed)
    }

    /// Records a relay round's outcomes for the relay holding `token` ([`record_outcomes`]).
    pub async fn record_outcomes(
        &self,
        token: i64,
        published: &[i64],
        failures: &[FailedAttempt],
    ) -> Result<(), Error> {
        let mut conn = self.pooled("marking outbox messages").await?;
        record_outcomes(
            &mut conn,
            &self.statements().outbox,
            token,
            published,
            failures,
        )
        .await
        .map_err(failed::<D>)
    }
}

/// Stages `message` under `id` (a new UUID v7, which the driver crate makes) on `conn`, a
/// connection of driver `D` in the transaction the message commits with (a handler's body),
/// whose statements are of `dialect`; returns the id. Wakes this process's relays at once when
/// no `#[idempotent]` call in this task will (a transaction of the caller's own).
pub async fn stage_message<D: Driver>(
    conn: &mut impl crate::Connection<Error = D::Error>,
    dialect: crate::Dialect,
    id: String,
    message: idem_core::outbox::Message,
) -> Result<String, Error> {
    message.validate()?;
    let headers = if message.headers().is_empty() {
        None
    } else {
        Some(
            serde_json::to_string(message.headers())
                .map_err(|e| Error::store("encoding message headers", e))?,
        )
    };
    let staged = super::NewMessage {
        id,
        topic: message.topic().to_owned(),
        aggregate: message.aggregate_key().map(str::to_owned),
        headers,
        payload: message.into_payload(),
    };
    for statement in super::Outbox::of(dialect).stage(&staged) {
        conn.execute(statement)
            .await
            .map_err(|e| db_error::<D>("staging an outbox message", e))?;
    }
    if !idem_core::outbox::note_staged() {
        // Not inside an `#[idempotent]` call: no commit to wait for that we can see.
        idem_core::outbox::wake();
    }
    Ok(staged.id)
}
