//! A lease-mode call's final phase, once for every driver: the handler's database writes in
//! one transaction that checks the lease ([`fence`]) and records them with a step, so they
//! commit exactly once even across takeovers; kept open for the call's result when the phase
//! is the handler's last work ([`OpenPhase`]). Each store's `final_step` and `finish`
//! ([`final_phases!`](crate::final_phases)) lend [`final_phase`] the phase's transaction as
//! their users' body type.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::time::Duration;

use idem_core::lease::{LeaseHandle, OpenPhase};
use idem_core::testing::crash_points::CrashPoint;
use idem_core::{BoxFuture, Error, RecordStatus, Ticket, detached};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::store::record_completion;
use super::{fence, record_final_step};
use crate::driver::{db_error, failed};
use crate::store::SqlStore;
use crate::{Driver, Sql, Transaction};

/// The future of a final phase's writes, borrowing the body it runs on.
pub type WritesFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// A store's final phase (`final_step`, `finish`; `what` names it in the error outside a
/// lease-mode call): a step the call recorded already answers without running `writes`;
/// otherwise they run in a transaction that also checks the lease and records the step
/// `name`, kept open for the call's result with `keep_open`. With idem switched off
/// ([`idem_core::testing`]), or for a body observe mode runs without a lease of the ledger
/// ([`LeaseHandle::fences_writes`]), the call's lease is in memory: the writes alone, in a
/// transaction.
pub async fn final_phase<D, T, E, F>(
    store: &SqlStore<D>,
    name: &str,
    what: &str,
    keep_open: bool,
    writes: F,
) -> Result<T, E>
where
    D: Driver,
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(&'t mut D::Tx) -> WritesFuture<'t, T, E>,
{
    if idem_core::testing::is_disabled() {
        return unfenced(store, writes).await;
    }
    let lease = LeaseHandle::current(what)?;
    if !lease.fences_writes() {
        return unfenced(store, writes).await;
    }
    if let Some(value) = lease.recorded::<T>(name)? {
        return Ok(value);
    }
    let encode = |value: &T| lease.encode(value);
    fenced(store, &lease, name, writes, encode, keep_open).await
}

/// Runs `writes` in a transaction that also checks `lease` and records the step `name`
/// (its value encoded by `encode`); with `keep_open`, the transaction waits for the call's
/// result ([`LeaseHandle::keep_open`]). The caller has checked that the step was not
/// recorded already. A holder that lost its lease gets [`Error::LeaseLost`] and its writes
/// roll back; every failure on the phase's connection goes through
/// [`LeaseHandle::store_failed`], so a server that went away under the phase makes the call
/// release its lease behind its answer.
///
/// `writes` runs in the phase's transaction; a store lends the handler's writes its body from
/// it ([`Driver::body`]: `&mut PgConnection`, `&DatabaseTransaction`).
async fn fenced<D, T, E, F>(
    store: &SqlStore<D>,
    lease: &LeaseHandle,
    name: &str,
    writes: F,
    encode: impl FnOnce(&T) -> Result<Vec<u8>, Error>,
    keep_open: bool,
) -> Result<T, E>
where
    D: Driver,
    E: From<Error>,
    F: for<'t> FnOnce(&'t mut D::Tx) -> WritesFuture<'t, T, E>,
{
    lease.commit_open_phase().await?;
    if lease.is_lost() {
        return Err(lease.lose().into());
    }
    idem_core::lease::reach_crash_point(CrashPoint::BeforeFinalStep, Some(name)).await;
    let ticket = lease.ticket();
    let doing = "beginning the final phase";
    let d = store
        .server_statements(doing)
        .await
        .map_err(|e| lease.store_failed(e))?;
    let mut tx = store
        .begin_lease_write(doing)
        .await
        .map_err(|e| lease.store_failed(e))?;
    // Fenced before the writes, the ledger row locked to the commit: a holder's writes run
    // only while it holds the lease, so they never see (nor wait on) a newer holder's. (Fenced
    // where it ends instead, a stale holder's writes ran against the state the takeover had
    // moved on, and its body answered from it: a state check failed where the truth was
    // "paid", in the Galera node-kill storm.)
    match fence(&mut tx, d, &ticket).await {
        Ok(true) => {}
        Ok(false) => {
            let _ = tx.rollback().await;
            return Err(lease.lose().into());
        }
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(lease.store_failed(failed::<D>(e)).into());
        }
    }
    let value = match writes(&mut tx).await {
        Ok(value) => value,
        Err(e) => {
            // The handler's error says nothing idem can read; a rollback that finds no
            // connection says the server went away.
            if let Err(rollback) = tx.rollback().await {
                lease.store_failed(db_error::<D>("rolling back the final phase", rollback));
            }
            return Err(e);
        }
    };
    let payload = encode(&value)?;
    lease.recording_step(name);
    let resumable = lease.is_resumable();
    if !keep_open {
        record_final_step(&mut tx, d, &ticket, name, &payload, resumable)
            .await
            .map_err(|e| lease.store_failed(failed::<D>(e)))?;
    }
    // A crash here drops the transaction, uncommitted, with the call.
    idem_core::lease::reach_crash_point(CrashPoint::FinalStepBeforeCommit, Some(name)).await;
    if keep_open {
        // The engine records the call's result in this transaction when the handler
        // returns, or commits it alone if the handler does more first. The step is written
        // only then: the result's record deletes the call's steps in the same transaction.
        lease.keep_open(
            name,
            Box::new(OpenFinalPhase::<D> {
                tx,
                d,
                step: (ticket, name.to_owned(), payload.clone()),
                resumable,
                driver: PhantomData,
            }),
        );
    } else {
        tx.commit()
            .await
            .map_err(|e| lease.store_failed(db_error::<D>("committing the final phase", e)))?;
    }
    lease.note_recorded(name, payload);
    idem_core::lease::reach_crash_point(CrashPoint::AfterFinalStep, Some(name)).await;
    Ok(value)
}

/// A final phase's writes with idem switched off ([`idem_core::testing`]): committed if they
/// succeed, nothing recorded.
async fn unfenced<D, T, E, F>(store: &SqlStore<D>, writes: F) -> Result<T, E>
where
    D: Driver,
    E: From<Error>,
    F: for<'t> FnOnce(&'t mut D::Tx) -> WritesFuture<'t, T, E>,
{
    let mut tx = store.begin_lease_write("beginning the final phase").await?;
    // Lent to the writes before any statement of idem's: a deferred `BEGIN` goes out now.
    tx.begun()
        .await
        .map_err(|e| db_error::<D>("beginning the final phase", e))?;
    let value = writes(&mut tx).await?;
    tx.commit()
        .await
        .map_err(|e| db_error::<D>("committing the final phase", e))?;
    Ok(value)
}

/// A final phase's transaction kept open for the call's result, its server's statements,
/// and whether the call is resumable.
struct OpenFinalPhase<D: Driver> {
    tx: D::Tx,
    d: &'static Sql,
    /// The phase's step (its ticket, name and value), written if the phase commits alone.
    step: (Ticket, String, Vec<u8>),
    resumable: bool,
    driver: PhantomData<fn() -> D>,
}

impl<D: Driver> OpenPhase for OpenFinalPhase<D> {
    fn complete(
        self: Box<Self>,
        ticket: Ticket,
        status: RecordStatus,
        payload: Vec<u8>,
        ttl: Duration,
        steps: Vec<String>,
    ) -> BoxFuture<'static, Result<(), Error>> {
        let this = *self;
        Box::pin(detached(async move {
            let outcome = (status, payload, ttl);
            record_completion::<D>(this.tx, this.d, ticket, outcome, &steps, this.resumable).await
        }))
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        let Self {
            mut tx,
            d,
            step: (ticket, name, payload),
            resumable,
            ..
        } = *self;
        Box::pin(detached(async move {
            record_final_step(&mut tx, d, &ticket, &name, &payload, resumable)
                .await
                .map_err(failed::<D>)?;
            tx.commit()
                .await
                .map_err(|e| db_error::<D>("committing the final phase", e))
        }))
    }
}

/// Writes a store's `final_step` and `finish` on its pool, with the body type its users'
/// writes take: `final_phases!([DB: Backend,] Pool<DB>, Sqlx<DB>, |'t| &'t mut DB::Connection,
/// "idem::sqlx")` (the store's generics end with a comma: they come first, as they did). The
/// docs and the calls into [`final_phase`] are written once, here; the signatures stay each
/// store's own, so a closure's argument is inferred as its body type.
#[doc(hidden)]
#[macro_export]
macro_rules! final_phases {
    ([$($generics:tt)*] $pool:ty, $driver:ty, |$t:lifetime| $body:ty, $path:literal) => {
        $crate::final_phases!(@phase final_step, false, [$($generics)*] $pool, $driver, |$t| $body, $path,
            /// The final phase of a lease-mode handler: runs `writes` in one transaction that
            /// also checks the lease and records the step `name`, so its database effects (a
            /// payment row, a guarded transition, an outbox message) commit exactly once even
            /// across takeovers. `writes` gets the phase's transaction as the store's body type
            /// (what the handler's `db` is in atomic mode). A takeover that finds the step
            /// recorded returns its value without running `writes` again. A holder that lost
            /// its lease gets `Error::LeaseLost` and its writes roll back.
            ///
            /// When the phase is the handler's last work, [`finish`] saves a write transaction.
            ///
            /// ```text
            /// let receipt = final_step(db, "record-payment", |tx| Box::pin(async move {
            ///     // tx: &mut PgConnection (sqlx), &DatabaseTransaction (SeaORM), &ClientWrapper
            ///     Ok(receipt)
            /// })).await?;
            /// ```
            ///
            /// # Errors
            /// `writes`' own error; `Error::LeaseLost`; `Error::Store` outside a lease-mode
            /// call or when the database fails.
        );
        $crate::final_phases!(@phase finish, true, [$($generics)*] $pool, $driver, |$t| $body, $path,
            /// [`final_step`] as the handler's last work: the phase's transaction stays open
            /// until the handler returns, and the call's result is recorded in it, so a call
            /// takes three write transactions (claim, steps, this) instead of four. Return its
            /// value (or something made from it, with no database work in between).
            ///
            /// Its writes become visible to other connections when the handler returns,
            /// together with the recorded result: read them back inside `writes`, not after.
            /// Database work after it waits at most 50 ms, after which the phase commits alone
            /// (and the result is recorded in a transaction of its own, as after
            /// [`final_step`]).
            ///
            /// # Errors
            /// As [`final_step`].
        );
    };
    (@phase $name:ident, $keep_open:literal, [$($generics:tt)*] $pool:ty, $driver:ty,
        |$t:lifetime| $body:ty, $path:literal, $(#[$doc:meta])*) => {
        $(#[$doc])*
        pub async fn $name<$($generics)* T, E, F>(
            pool: &$pool,
            name: &str,
            writes: F,
        ) -> Result<T, E>
        where
            T: ::serde::Serialize + ::serde::de::DeserializeOwned,
            E: ::core::convert::From<::idem_core::Error>,
            F: for<$t> FnOnce($body) -> $crate::WritesFuture<$t, T, E>,
        {
            let store = $crate::SqlStore::<$driver>::new(pool);
            let what = concat!($path, "::", stringify!($name));
            $crate::final_phase(&store, name, what, $keep_open, |tx| {
                writes(<$driver as $crate::Driver>::body(tx))
            })
            .await
        }
    };
}
