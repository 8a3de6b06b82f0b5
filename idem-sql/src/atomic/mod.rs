//! The atomic-mode claim, once for every store: which of the ledger's statements run, in
//! which order, and what their rows decide. The store supplies the connection (its claim
//! transaction, begun, on any driver's [`Connection`]) and ends the transaction as the
//! [`Claimed`] it gets back says.

mod nested;
mod store;

use idem_core::{Claim, Fingerprint, RecordStatus, Recorded, Request};

pub use nested::{ConnClaimed, ConnStore, Nested, NestedClaim};
pub use store::ClaimedTx;

use crate::{
    Column, Connection, Decode, Driver, Failure, Fault, NewRecord, Row, Sql, fetch_first, millis,
};

/// A ledger row as a claim reads it back: the columns every claim statement returns, in
/// their order (owner, fingerprint, state, response, expires_at_ms, now_ms).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRow {
    /// The owner token of the claim that wrote the row.
    pub owner: i64,
    /// The arguments' fingerprint.
    pub fingerprint: Fingerprint,
    /// The record's state (`None`: a code this version does not know).
    pub status: Option<RecordStatus>,
    /// The recorded answer, if any.
    pub response: Option<Vec<u8>>,
    /// When the record (or lease) ends, in the database clock's epoch milliseconds.
    pub expires_at_ms: i64,
    /// The database clock when the row was read.
    pub now_ms: i64,
}

impl ClaimRow {
    /// The columns every claim statement returns ([`crate::Ledger::claim`],
    /// [`crate::Ledger::read_locked`], …), in order.
    pub const COLUMNS: &'static [Column] = &[
        Column::I64,
        Column::Bytes,
        Column::I16,
        Column::Bytes,
        Column::I64,
        Column::I64,
    ];

    /// The row a claim statement returned ([`ClaimRow::COLUMNS`]).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(ClaimRow::from_columns(
            c.i64()?,
            c.bytes()?,
            c.int()?,
            c.opt_bytes()?,
            c.i64()?,
            c.i64()?,
        ))
    }

    /// The row from its columns as a driver decodes them.
    pub fn from_columns(
        owner: i64,
        fingerprint: Vec<u8>,
        state: i16,
        response: Option<Vec<u8>>,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Self {
        ClaimRow {
            owner,
            fingerprint: Fingerprint(fingerprint.try_into().unwrap_or([0; 32])),
            status: RecordStatus::from_code(state),
            response,
            expires_at_ms,
            now_ms,
        }
    }

    /// Whether the record was still live when read.
    pub fn is_live(&self) -> bool {
        self.expires_at_ms > self.now_ms
    }

    /// What a live record answers a claim: in flight, or its recorded outcome; `None` for a
    /// state this version does not know.
    pub fn answer<T>(self) -> Option<Claim<T>> {
        match self.status? {
            RecordStatus::Pending => Some(Claim::InFlight),
            status => Some(Claim::Recorded(Recorded {
                fingerprint: self.fingerprint,
                status,
                payload: self.response.unwrap_or_default(),
            })),
        }
    }
}

impl NewRecord {
    /// The row a claim of `req` by `owner` writes, living `lives` from the database clock.
    pub fn of(req: &Request, owner: i64, lives: std::time::Duration) -> Self {
        NewRecord {
            id: req.id().to_vec(),
            scope: req.scope().to_owned(),
            principal: req.principal().to_owned(),
            key: req.key().to_owned(),
            owner,
            fingerprint: req.fingerprint().0.to_vec(),
            ttl_ms: millis(lives),
        }
    }
}

/// What a claim decided, and so how its store ends the transaction.
#[derive(Debug)]
pub enum Claimed {
    /// The key is this claim's: the body runs in the transaction.
    Execute,
    /// A live record answers (see [`ClaimRow::answer`]); the transaction wrote nothing and
    /// can be dropped.
    Live(ClaimRow),
    /// A live record answers, and the transaction holds its row lock: under `reject` on the
    /// MySQL protocol the store rolls back before answering, so the client's next call does
    /// not meet this call's lock.
    LiveLocked(ClaimRow),
    /// Another transaction holds the key and the claim would not wait (`reject`).
    InFlight,
}

/// One claim's values and decisions.
#[derive(Clone, Debug)]
pub struct ClaimStep {
    /// The row the claim inserts ([`NewRecord::of`]; SQLite's atomic claim only reads its id).
    pub row: NewRecord,
    /// `on_concurrent = reject`: fail at once instead of waiting for the key's lock.
    pub reject: bool,
    /// Take a savepoint after the claim, so a final error can undo the body's writes.
    pub savepoint: bool,
}

/// What a claim's step returns: its answer, or what it was doing when a statement failed.
type Done<T, C> = Result<T, (&'static str, Fault<<C as Connection>::Error>)>;

/// Claims `step.row` in `conn`, a transaction of driver `D` that has just begun, with `d`'s
/// statements. An error says what the claim was doing.
pub async fn claim<D: Driver, C: Connection<Error = D::Error>>(
    conn: &mut C,
    d: &'static Sql,
    step: &ClaimStep,
) -> Done<Claimed, C> {
    if step.reject
        && let Some(sql) = d.ledger.before_nowait
    {
        conn.execute_unprepared(sql)
            .await
            .map_err(|e| ("setting the lock timeout", Fault::Db(e)))?;
    }
    if d.ledger.claim_by_read {
        // SQLite: `BEGIN IMMEDIATE` already holds the only write lock, so nobody can claim
        // the key before this transaction ends. A plain read decides, and the record step
        // writes the whole row once (an upsert over an expired record).
        let row = fetch_first(conn, d.ledger.read_locked(&step.row.id), ClaimRow::from_row)
            .await
            .map_err(|e| ("reading the key", e))?;
        if let Some(row) = row
            && row.is_live()
        {
            return Ok(Claimed::Live(row));
        }
        return savepoint(conn, d, step).await;
    }
    let insert = if step.reject {
        d.ledger.claim_nowait(&step.row)
    } else {
        d.ledger.claim(&step.row)
    };
    let seen = fetch_first(conn, insert, ClaimRow::from_row).await;
    if step.reject
        && let Some(sql) = d.ledger.after_nowait
    {
        conn.execute_unprepared(sql)
            .await
            .map_err(|e| ("resetting the lock timeout", Fault::Db(e)))?;
    }
    let seen = match seen {
        Ok(seen) => seen,
        Err(e) if e.failure(D::classify) == Failure::LockTimeout => return Ok(Claimed::InFlight),
        Err(e) => return Err(("claiming the key", e)),
    };
    match seen {
        // Our new row, or (MariaDB) the current row, locked: it decides.
        Some(row) if row.owner == step.row.owner || d.ledger.claim_locks_row => {
            return settle(conn, d, row, step).await;
        }
        // A committed final record never changes before it expires: it answers as the
        // statement saw it, without a lock or a second read.
        Some(row)
            if row.is_live()
                && matches!(
                    row.status,
                    Some(RecordStatus::Completed | RecordStatus::Failed | RecordStatus::GaveUp)
                ) =>
        {
            return Ok(Claimed::Live(row));
        }
        _ => {}
    }
    // Another owner's row, seen without a lock: read it locked, as it is now.
    let doing = "reading the claimed key";
    let row = fetch_first(conn, d.ledger.read_locked(&step.row.id), ClaimRow::from_row)
        .await
        .map_err(|e| (doing, e))?
        .ok_or((doing, Fault::Missing("the claimed ledger row")))?;
    settle(conn, d, row, step).await
}

/// Decides on the current, locked row of the key: ours, another owner's live record, or an
/// expired record this claim takes over.
async fn settle<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    row: ClaimRow,
    step: &ClaimStep,
) -> Done<Claimed, C> {
    if row.owner != step.row.owner {
        if row.is_live() {
            return Ok(Claimed::LiveLocked(row));
        }
        // An expired record is a new execution: take it over in this transaction.
        let new = &step.row;
        conn.execute(
            d.ledger
                .take_over(&new.id, new.owner, &new.fingerprint, new.ttl_ms),
        )
        .await
        .map_err(|e| ("taking over an expired key", Fault::Db(e)))?;
    }
    savepoint(conn, d, step).await
}

/// The key is the claim's: a savepoint first if a final error may need one.
async fn savepoint<C: Connection>(
    conn: &mut C,
    d: &'static Sql,
    step: &ClaimStep,
) -> Done<Claimed, C> {
    if step.savepoint {
        conn.execute_unprepared(&d.ledger.savepoint().sql)
            .await
            .map_err(|e| ("taking the claim savepoint", Fault::Db(e)))?;
    }
    Ok(Claimed::Execute)
}
