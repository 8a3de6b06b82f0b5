//! Lease mode on [`SqlStore`], once for every driver: idem-core's [`LeaseStore`] (the claim,
//! renewals, steps, the completion, the release, each one of this folder's algorithms in a
//! transaction or one fenced statement), and its one-statement writes: at once, or on SQLite
//! committed in groups ([`write_grouped`]: the queue, who leads and who waits) through the
//! store's [`GroupCommit`].

use std::time::Duration;

use idem_core::ledger::ids::random_token;
use idem_core::{
    BoxFuture, Error, LeaseClaim, LeaseStore, RecordStatus, Request, Ticket, detached,
};

use super::group_commit::{GroupCommit, write_grouped};
use super::{LeaseStep, LeaseWrite, LeaseWritten, claim_lease, complete, completion, record_step};
use crate::driver::fetch_first;
use crate::driver::{db_error, failed};
use crate::store::{SqlStore, within};
use crate::{Begin, Bound, ClaimRow, Connection, Dialect, Driver, Fault, Sql, Transaction, millis};

impl<D: Driver> SqlStore<D> {
    /// Applies `write`: on SQLite with the writes that arrive meanwhile, in one transaction;
    /// elsewhere at once.
    pub async fn write_lease(&self, write: LeaseWrite) -> Result<LeaseWritten, Fault<D::Error>> {
        if self.driver().dialect() != Dialect::Sqlite {
            return self.apply(write).await;
        }
        // A handle that is not a pool of its own (a mock, a proxy) shares one queue.
        let pool = self.driver().identity().unwrap_or(0);
        write_grouped(self, pool, write).await
    }
}

/// Applies `write` on `conn`.
async fn apply<C: Connection>(
    conn: &mut C,
    write: LeaseWrite,
) -> Result<LeaseWritten, Fault<C::Error>> {
    match write {
        LeaseWrite::Claim { claim, read } => {
            let row = match fetch_first(conn, claim, ClaimRow::from_row).await? {
                Some(row) => Some(row),
                // SQLite's `DO NOTHING` returns no row; nor does PostgreSQL's for a row
                // committed while its insert waited: read it, committed.
                None => fetch_first(conn, read, ClaimRow::from_row).await?,
            };
            Ok(LeaseWritten::Row(row))
        }
        LeaseWrite::Update(update) => conn
            .execute(update)
            .await
            .map(LeaseWritten::Changed)
            .map_err(Fault::Db),
    }
}

impl<D: Driver> GroupCommit for SqlStore<D> {
    type Error = Fault<D::Error>;
    type Tx = D::Tx;

    async fn apply(&self, write: LeaseWrite) -> Result<LeaseWritten, Fault<D::Error>> {
        let mut conn = self.driver().acquire().await.map_err(Fault::Db)?;
        apply(&mut conn, write).await
    }

    async fn begin(&self) -> Result<D::Tx, Fault<D::Error>> {
        self.driver().begin(Begin::Write).await.map_err(Fault::Db)
    }

    async fn apply_in(tx: &mut D::Tx, write: LeaseWrite) -> Result<LeaseWritten, Fault<D::Error>> {
        apply(tx, write).await
    }

    async fn commit(tx: D::Tx) -> Result<(), Fault<D::Error>> {
        tx.commit().await.map_err(Fault::Db)
    }

    fn group_failed(why: String) -> Fault<D::Error> {
        Fault::Group(why)
    }
}

impl<D: Driver> SqlStore<D> {
    /// The lease claim ([`claim_lease`]): first as one auto-committed statement where it can
    /// settle the answer (one round trip, one commit; on SQLite with the group of concurrent
    /// writes), else in a transaction under the row's lock. Each wait for a connection is
    /// bounded by `wait`.
    async fn claim_lease_now(
        self,
        step: LeaseStep,
        wait: Option<Duration>,
    ) -> Result<LeaseClaim, Error> {
        let doing = "claiming a lease";
        let d = within(wait, doing, self.server_statements(doing)).await?;
        if step.claims_at_once(d) {
            let (claim, read) = step.at_once(d);
            let write = self.write_lease(LeaseWrite::Claim { claim, read });
            let written = within(wait, doing, async {
                write.await.map_err(|e| failed::<D>((doing, e)))
            })
            .await?;
            if let LeaseWritten::Row(row) = written
                && let Some(answer) = step.answer_at_once(row)
            {
                return Ok(answer);
            }
        }
        let mut tx = within(wait, doing, self.begin_write(doing)).await?;
        let answer = claim_lease(&mut tx, d, &step).await.map_err(failed::<D>)?;
        tx.commit().await.map_err(|e| db_error::<D>(doing, e))?;
        Ok(answer)
    }

    /// Runs the fenced `update` on its own (on SQLite with the group of concurrent writes)
    /// and answers whether it changed the held record.
    async fn fenced_update(
        &self,
        update: Bound<'static>,
        doing: &'static str,
    ) -> Result<bool, Error> {
        let write = self.write_lease(LeaseWrite::Update(update));
        let written = within(self.driver().connection_wait(), doing, async {
            write.await.map_err(|e| failed::<D>((doing, e)))
        })
        .await?;
        // Updates by primary key change one row or none; MySQL counts a step's upsert that
        // replaced a row as two (and, with `CLIENT_FOUND_ROWS`, one that left it unchanged as
        // one).
        Ok(matches!(written, LeaseWritten::Changed(n) if n > 0))
    }

    /// A write transaction for lease mode, its wait for a connection bounded.
    pub(crate) async fn begin_lease_write(&self, doing: &'static str) -> Result<D::Tx, Error> {
        within(
            self.driver().connection_wait(),
            doing,
            self.begin_write(doing),
        )
        .await
    }
}

/// Records a lease-mode call's outcome in `tx` if `ticket` still holds the lease
/// ([`complete`]: kept for `ttl` from now, its `steps` and, for a `resumable` call, its stored
/// call forgotten), and commits.
pub(crate) async fn record_completion<D: Driver>(
    mut tx: D::Tx,
    d: &'static Sql,
    ticket: Ticket,
    outcome: (RecordStatus, Vec<u8>, Duration),
    steps: &[String],
    resumable: bool,
) -> Result<(), Error> {
    let held = complete(&mut tx, d, &ticket, outcome, steps, resumable)
        .await
        .map_err(failed::<D>)?;
    if !held {
        return Err(lost());
    }
    // Inside a step that finishes on its own task once dropped: a crash test's crash here
    // fails it, the transaction dropped uncommitted.
    idem_core::testing::crash_points::fault(
        idem_core::testing::crash_points::CrashPoint::BeforeLeaseCommit,
    )?;
    tx.commit()
        .await
        .map_err(|e| db_error::<D>("recording the result", e))
}

/// A lease that another holder took over, or that ended.
pub(crate) fn lost() -> Error {
    // The scope is not known here; the engine's span carries it.
    Error::LeaseLost {
        scope: String::new(),
    }
}

impl<D: Driver> LeaseStore for SqlStore<D> {
    fn claim_lease<'a>(
        &'a self,
        req: &'a Request,
        lease: Duration,
    ) -> BoxFuture<'a, Result<LeaseClaim, Error>> {
        // SQLite: an atomic body in this task holds the database's one write lock, which the
        // lease's claim would wait for. (Elsewhere the lease commits on its own, as it must.)
        if self.driver().dialect() == Dialect::Sqlite
            && let Err(e) = idem_core::atomic::lease_outside_open_sqlite_claim(
                self.driver().identity(),
                req.scope(),
            )
        {
            return Box::pin(async move { Err(e) });
        }
        let step = LeaseStep::of(req, random_token(), lease);
        let wait = self
            .driver()
            .connection_wait()
            .map(|wait| req.concurrency().connection_wait(wait));
        Box::pin(detached(self.clone().claim_lease_now(step, wait)))
    }

    fn renew<'a>(
        &'a self,
        ticket: &'a Ticket,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let renew = self
            .statements()
            .lease
            .renew(&ticket.id, ticket.token, millis(lease));
        let store = self.clone();
        Box::pin(detached(async move {
            if store.fenced_update(renew, "renewing a lease").await? {
                Ok(())
            } else {
                Err(lost())
            }
        }))
    }

    fn record_step<'a>(
        &'a self,
        ticket: &'a Ticket,
        name: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), Error>> {
        let (store, ticket, name, payload) =
            (self.clone(), *ticket, name.to_owned(), payload.to_vec());
        Box::pin(detached(async move {
            let doing = "recording a step";
            let d = store.server_statements(doing).await?;
            if let Some(step) =
                d.lease
                    .insert_step_fenced(&ticket.id, &name, ticket.token, &payload)
            {
                // One statement where the transaction takes four (all but Galera).
                let held = store.fenced_update(step, doing).await?;
                return if held { Ok(()) } else { Err(lost()) };
            }
            let mut tx = store.begin_lease_write(doing).await?;
            let held = record_step(&mut tx, d, &ticket, &name, &payload)
                .await
                .map_err(failed::<D>)?;
            if !held {
                return Err(lost());
            }
            tx.commit().await.map_err(|e| db_error::<D>(doing, e))
        }))
    }

    fn complete<'a>(
        &'a self,
        ticket: &'a Ticket,
        req: &'a Request,
        status: RecordStatus,
        payload: &'a [u8],
        steps: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        let (store, ticket, payload, ttl) = (self.clone(), *ticket, payload.to_vec(), req.ttl());
        let resumable = req.stored_args().is_some();
        let steps = steps.to_vec();
        Box::pin(detached(async move {
            let doing = "recording the result";
            let d = store.server_statements(doing).await?;
            let outcome = (status, payload, ttl);
            let forget_steps = !steps.is_empty();
            if d.lease.completes_in_one_statement() || (!forget_steps && !resumable) {
                // One fenced statement outside a transaction: the update alone, or (PostgreSQL)
                // with the deletes of what the call leaves behind.
                let update = completion(d, &ticket, outcome, forget_steps, resumable)
                    .ok_or_else(|| failed::<D>((doing, Fault::Missing("the completion"))))?;
                return if store.fenced_update(update, doing).await? {
                    Ok(())
                } else {
                    Err(lost())
                };
            }
            let tx = store.begin_lease_write(doing).await?;
            record_completion::<D>(tx, d, ticket, outcome, &steps, resumable).await
        }))
    }

    fn release_lease<'a>(&'a self, ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>> {
        let release = self.statements().lease.release(&ticket.id, ticket.token);
        let store = self.clone();
        Box::pin(detached(async move {
            store
                .fenced_update(release, "ending a lease")
                .await
                .map(drop)
        }))
    }
}
