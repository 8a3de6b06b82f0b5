//! Lease mode's algorithm, once for every store: which of the ledger's and the steps table's
//! statements a lease claim runs and what their rows decide ([`claim_lease`],
//! [`LeaseStep::answer_at_once`], [`settled`]), the fence every write of a holder passes
//! ([`fence`]), a step's record ([`record_step`]), a final phase's step ([`record_final_step`])
//! and the completion ([`complete`]). The store supplies the connection (any driver's
//! [`Connection`]: a transaction it began), begins and commits it, and turns a `false` ("the
//! ticket no longer holds") into [`Error::LeaseLost`](idem_core::Error::LeaseLost).

use std::time::Duration;

use idem_core::{Fingerprints, LeaseClaim, RecordStatus, Recorded, Request, Ticket};

mod group_commit;
mod operator;
mod phase;
mod statements;
mod store;

pub use group_commit::{GroupCommit, LeaseWrite, LeaseWritten, write_grouped};
pub use operator::{ExpiredLease, StuckLease, expired_leases, release_lease, stuck_leases};
pub use phase::{WritesFuture, final_phase};
pub use statements::{Lease, read_step};

use crate::driver::{fetch_each, fetch_first};
use crate::{Bound, ClaimRow, Connection, Fault, NewCall, NewRecord, Sql, millis};

/// What a step of lease mode returns: its answer, or what it was doing when a statement
/// failed.
type Done<T, C> = Result<T, (&'static str, Fault<<C as Connection>::Error>)>;

/// One lease claim's values, owned: a claim runs to completion even when its caller stops
/// waiting, so it cannot borrow the request.
#[derive(Clone, Debug)]
pub struct LeaseStep {
    /// The row a new execution writes: in progress, living the lease.
    pub row: NewRecord,
    /// A resumable call's stored arguments, written with every new execution.
    pub call: Option<NewCall>,
    /// The request's fingerprints (the current one, and version 1's for older records).
    pub fingerprints: Fingerprints,
    /// The lease, in milliseconds.
    pub lease_ms: i64,
}

impl LeaseStep {
    /// The claim of `req` by `owner` (a fresh [`random_token`](idem_core::ledger::ids::random_token))
    /// with a lease of `lease`.
    pub fn of(req: &Request, owner: i64, lease: Duration) -> Self {
        LeaseStep {
            row: NewRecord::of(req, owner, lease),
            call: req.stored_args().map(|args| NewCall {
                id: req.id().to_vec(),
                scope: req.scope().to_owned(),
                args: args.to_vec(),
                ttl_ms: millis(req.ttl()),
            }),
            fingerprints: req.fingerprints().clone(),
            lease_ms: millis(lease),
        }
    }

    /// The record id.
    fn id(&self) -> [u8; 32] {
        self.row.id.as_slice().try_into().unwrap_or([0; 32])
    }

    /// The ticket of a holder with `token`, its lease counted from the database clock `now_ms`.
    fn ticket(&self, token: i64, now_ms: i64) -> Ticket {
        Ticket::new(self.id(), token, now_ms + self.lease_ms)
    }

    /// Whether the claim may first be tried as one statement outside a transaction (one round
    /// trip, one commit): where `d` allows it (not Galera nor the MySQL 8 family), and never
    /// for a resumable call, whose arguments are stored in the claim's transaction.
    pub fn claims_at_once(&self, d: &Sql) -> bool {
        self.call.is_none() && d.ledger.claim_at_once
    }

    /// The one-statement claim ([`claims_at_once`](Self::claims_at_once)): the insert of a new
    /// key, and the read of the committed row it ran into, for when the insert returns no row
    /// (SQLite's `DO NOTHING`; PostgreSQL's for a row committed while the insert waited). A
    /// store runs the read only when the claim returned no row, then asks
    /// [`answer_at_once`](Self::answer_at_once).
    pub fn at_once<'d>(&self, d: &'d Sql) -> (Bound<'d>, Bound<'d>) {
        (d.ledger.claim(&self.row), d.ledger.read_row(&self.row.id))
    }

    /// What the row a one-statement claim returned decides: this claim's own new row (run
    /// the body), or another's that [`settled`] answers. `None`: it settles nothing (an
    /// ended lease or record to take over, a row purged in between), so [`claim_lease`]
    /// decides under the row's lock.
    pub fn answer_at_once(&self, row: Option<ClaimRow>) -> Option<LeaseClaim> {
        let row = row?;
        if row.owner == self.row.owner {
            return Some(LeaseClaim::Execute {
                ticket: self.ticket(self.row.owner, row.now_ms),
                steps: Vec::new(),
            });
        }
        settled(&row, &self.fingerprints)
    }
}

/// The answer a ledger row gives another caller whatever commits next, if it has one: the
/// key reused with other arguments, a live lease, a live record. `None` for a record or
/// lease that ended: taking it over needs the row locked.
pub fn settled(row: &ClaimRow, fingerprints: &Fingerprints) -> Option<LeaseClaim> {
    let live = row.is_live();
    match row.status {
        _ if !fingerprints.matches(&row.fingerprint)
            && (live || row.status == Some(RecordStatus::Pending)) =>
        {
            // Another payload under this key: the engine answers KeyReused.
            Some(LeaseClaim::Recorded(Recorded {
                fingerprint: row.fingerprint,
                status: row.status.unwrap_or(RecordStatus::Pending),
                payload: Vec::new(),
            }))
        }
        Some(RecordStatus::Pending) if live => Some(LeaseClaim::InFlight {
            retry_after: Duration::from_millis(
                u64::try_from(row.expires_at_ms - row.now_ms).unwrap_or(0),
            ),
        }),
        Some(RecordStatus::Completed | RecordStatus::Failed | RecordStatus::GaveUp) if live => {
            Some(LeaseClaim::Recorded(Recorded {
                fingerprint: row.fingerprint,
                status: row.status.unwrap_or(RecordStatus::Completed),
                payload: row.response.clone().unwrap_or_default(),
            }))
        }
        _ => None,
    }
}

/// The lease claim in `conn`, a transaction that has just begun (the store commits it
/// whatever the answer): inserts the key if absent, reads its row back locked, and decides.
/// A new key or an ended record is a new execution (a resumable call's arguments stored with
/// it); a lease that ended is taken over with the next token, after its recorded steps. An
/// error says what the claim was doing.
pub async fn claim_lease<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    step: &LeaseStep,
) -> Done<LeaseClaim, C> {
    let failed = |e| ("claiming a lease", e);
    let id = &step.row.id;
    conn.execute(d.ledger.claim(&step.row))
        .await
        .map_err(|e| failed(Fault::Db(e)))?;
    let row = fetch_first(conn, d.ledger.read_locked(id), ClaimRow::from_row)
        .await
        .map_err(failed)?
        .ok_or(failed(Fault::Missing("the claimed ledger row")))?;
    let owner = step.row.owner;
    if row.owner != owner {
        if let Some(answer) = settled(&row, &step.fingerprints) {
            return Ok(answer);
        }
        if row.status == Some(RecordStatus::Pending) {
            // The holder's lease ended: take over with the next token, resume after its steps.
            let token = row.owner.wrapping_add(1);
            take_over(conn, d, step, token).await?;
            let steps = fetch_each(conn, d.lease.select_steps(id), read_step)
                .await
                .map_err(failed)?;
            return Ok(LeaseClaim::Execute {
                ticket: step.ticket(token, row.now_ms),
                steps,
            });
        }
        // An expired record (or an unknown state): a new execution.
        take_over(conn, d, step, owner).await?;
        conn.execute(d.lease.delete_steps(id))
            .await
            .map_err(|e| failed(Fault::Db(e)))?;
    }
    // A new execution stores a resumable call's arguments in the claim's transaction: there
    // is never a claim a completer cannot rebuild.
    if let Some(call) = &step.call {
        conn.execute(d.completer.insert_call(call))
            .await
            .map_err(|e| failed(Fault::Db(e)))?;
    }
    Ok(LeaseClaim::Execute {
        ticket: step.ticket(owner, row.now_ms),
        steps: Vec::new(),
    })
}

async fn take_over<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    step: &LeaseStep,
    token: i64,
) -> Done<(), C> {
    let row = &step.row;
    conn.execute(
        d.ledger
            .take_over(&row.id, token, &row.fingerprint, step.lease_ms),
    )
    .await
    .map(drop)
    .map_err(|e| ("taking over a lease", Fault::Db(e)))
}

/// Locks the ledger row of `ticket` in `conn` and answers whether the ticket still holds it
/// (the same token, the call still in progress). Every write of a holder passes it first. On
/// Galera it writes the row ([`Lease::fence_by_write`](crate::Lease::fence_by_write)).
pub async fn fence<C: Connection>(conn: &mut C, d: &'static Sql, ticket: &Ticket) -> Done<bool, C> {
    if let Some(write) = d.lease.fence_by_write(&ticket.id, ticket.token) {
        let written = conn
            .execute(write)
            .await
            .map_err(|e| ("checking the lease", Fault::Db(e)))?;
        return Ok(written == 1);
    }
    let row = fetch_first(conn, d.ledger.read_locked(&ticket.id), ClaimRow::from_row)
        .await
        .map_err(|e| ("checking the lease", e))?;
    Ok(row
        .is_some_and(|row| row.owner == ticket.token && row.status == Some(RecordStatus::Pending)))
}

/// Records step `name` with `payload` in `conn` if `ticket` still holds the lease; `false`
/// (nothing written) if it does not.
pub async fn record_step<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    ticket: &Ticket,
    name: &str,
    payload: &[u8],
) -> Done<bool, C> {
    if !fence(conn, d, ticket).await? {
        return Ok(false);
    }
    conn.execute(d.lease.insert_step(&ticket.id, name, ticket.token, payload))
        .await
        .map_err(|e| ("recording a step", Fault::Db(e)))?;
    Ok(true)
}

/// A final phase's step, after its writes, in the phase's transaction (which [`fence`]
/// checked before them): records step `name`, and for a resumable call notes that a completer
/// must complete it, never give it up (its effects are done).
pub async fn record_final_step<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    ticket: &Ticket,
    name: &str,
    payload: &[u8],
    resumable: bool,
) -> Done<(), C> {
    conn.execute(d.lease.insert_step(&ticket.id, name, ticket.token, payload))
        .await
        .map_err(|e| ("recording a step", Fault::Db(e)))?;
    if resumable {
        conn.execute(d.completer.note_final_phase(&ticket.id))
            .await
            .map_err(|e| ("recording the final phase", Fault::Db(e)))?;
    }
    Ok(())
}

/// The fenced completion of the call `ticket` holds as one statement, where it is one: its
/// outcome, kept for `ttl` from now; the update alone when the call has no steps to forget
/// (`forget_steps` false) and stores no call, else the update that forgets them with it
/// ([`Lease::complete_and_forget`], PostgreSQL). `None` where forgetting them takes a
/// transaction: [`complete`].
pub fn completion<'d>(
    d: &'d Sql,
    ticket: &Ticket,
    (status, payload, ttl): (RecordStatus, Vec<u8>, Duration),
    forget_steps: bool,
    resumable: bool,
) -> Option<Bound<'d>> {
    let (id, token, state, ttl_ms) = (&ticket.id, ticket.token, status.code(), millis(ttl));
    if !forget_steps && !resumable {
        return Some(d.lease.complete(id, token, state, payload, ttl_ms));
    }
    d.lease
        .complete_and_forget(id, token, state, payload, ttl_ms, resumable)
}

/// Records a lease-mode call's outcome in `conn` if `ticket` still holds the lease (kept for
/// `ttl` from now), forgets its `steps` (every step that may be recorded under its key,
/// [`LeaseStore::complete`](idem_core::LeaseStore::complete)) and, for a `resumable` call, its
/// stored call; `false` (nothing written) if the ticket no longer holds. The store commits.
pub async fn complete<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    ticket: &Ticket,
    outcome: (RecordStatus, Vec<u8>, Duration),
    steps: &[String],
    resumable: bool,
) -> Done<bool, C> {
    let failed = |e| ("recording the result", e);
    if d.lease.completes_in_one_statement() {
        let statement = completion(d, ticket, outcome, !steps.is_empty(), resumable)
            .ok_or(failed(Fault::Missing("the one-statement completion")))?;
        let completed = conn
            .execute(statement)
            .await
            .map_err(|e| failed(Fault::Db(e)))?;
        return Ok(completed == 1);
    }
    let (status, payload, ttl) = outcome;
    let updated = conn
        .execute(d.lease.complete(
            &ticket.id,
            ticket.token,
            status.code(),
            payload,
            millis(ttl),
        ))
        .await
        .map_err(|e| failed(Fault::Db(e)))?;
    if updated != 1 {
        return Ok(false);
    }
    forget_steps(conn, d, &ticket.id, steps)
        .await
        .map_err(|e| failed(Fault::Db(e)))?;
    // Only a resumable call has a stored call: the others save the round trip.
    if resumable {
        conn.execute(d.completer.delete_call(&ticket.id))
            .await
            .map_err(|e| failed(Fault::Db(e)))?;
    }
    Ok(true)
}

/// Deletes a finished call's `steps`: by primary key where a range delete would take gap
/// locks (MySQL). The holder names them (the lease fenced out every other writer), so no read
/// looks for them first; none, no statement.
async fn forget_steps<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    id: &[u8],
    steps: &[String],
) -> Result<(), C::Error> {
    if steps.is_empty() {
        return Ok(());
    }
    let delete = d
        .lease
        .delete_steps_by_key(id, steps)
        .unwrap_or_else(|| d.lease.delete_steps(id));
    conn.execute(delete).await.map(drop)
}
