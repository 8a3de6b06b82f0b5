//! What the inspection reads, each from its statement's row: the ledger row whole
//! ([`LedgerRow`]) and the views an operator sees of a record ([`RecordView`]), its steps and
//! its stored call.

use idem_core::RecordStatus;

use crate::{Decode, Row};

/// One ledger row, every column: the record as idem stores it (SeaORM's `ledger::Model` has
/// the same fields, and converts from it).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LedgerRow {
    /// SHA-256 over scope, principal and key (length-prefixed).
    pub id: Vec<u8>,
    /// The handler's scope, e.g. `orders.pay`.
    pub scope: String,
    /// The principal, or an empty string.
    pub principal: String,
    /// The idempotency key.
    pub idem_key: String,
    /// Random token of the attempt that wrote the record (lease mode: the fencing token).
    pub owner: i64,
    /// SHA-256 fingerprint of the arguments.
    pub fingerprint: Vec<u8>,
    /// The state's code (see [`RecordStatus`]).
    pub state: i16,
    /// The recorded value or error, as JSON bytes.
    pub response: Option<Vec<u8>>,
    /// Database time of the claim, epoch milliseconds.
    pub created_at_ms: i64,
    /// Database time after which the record is expired (in progress: the lease's end).
    pub expires_at_ms: i64,
}

/// One ledger record as it stands, read in one snapshot: the row, the steps of a call in
/// progress, and its stored call if it is resumable.
///
/// idem does not count replays: a replay reads the record and writes nothing, so how often a
/// key was answered from the ledger is not stored anywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordView {
    /// The ledger row.
    pub record: LedgerRow,
    /// The database clock when the record was read (epoch milliseconds).
    pub now_ms: i64,
    /// Steps the call recorded, oldest first (only calls in progress, or given up with their
    /// hook owed, keep them).
    pub steps: Vec<StepView>,
    /// The stored call of a resumable call in progress (or given up with its hook owed).
    pub call: Option<CallView>,
}

impl RecordView {
    /// The state, or `None` for a code this version does not know.
    pub fn status(&self) -> Option<RecordStatus> {
        RecordStatus::from_code(self.record.state)
    }

    /// A row of [`Inspect::record`](crate::Inspect::record) or
    /// [`Inspect::list_records`](crate::Inspect::list_records) ([`Inspect::RECORD`](crate::Inspect::RECORD)),
    /// without its steps and call.
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(RecordView {
            record: LedgerRow {
                id: c.bytes()?,
                scope: c.text()?,
                principal: c.text()?,
                idem_key: c.text()?,
                owner: c.i64()?,
                fingerprint: c.bytes()?,
                state: c.int()?,
                response: c.opt_bytes()?,
                created_at_ms: c.i64()?,
                expires_at_ms: c.i64()?,
            },
            now_ms: c.i64()?,
            steps: Vec::new(),
            call: None,
        })
    }
}

/// A step a lease-mode call recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepView {
    /// The step's name.
    pub name: String,
    /// The fencing token of the holder that recorded it.
    pub token: i64,
    /// Its value, as JSON bytes.
    pub value: Vec<u8>,
    /// When it was recorded (epoch milliseconds, database clock).
    pub created_at_ms: i64,
}

impl StepView {
    /// A row of [`Inspect::steps`](crate::Inspect::steps) ([`Inspect::STEP`](crate::Inspect::STEP)).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(StepView {
            name: c.text()?,
            token: c.i64()?,
            value: c.bytes()?,
            created_at_ms: c.i64()?,
        })
    }
}

/// A resumable call's stored call: what a completer works from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallView {
    /// Attempts completers have started.
    pub attempts: u32,
    /// The last attempt's error.
    pub last_error: Option<String>,
    /// Whether the call was given up and its give-up hook has not yet reported success.
    pub hook_owed: bool,
    /// When a completer may next work on it (epoch milliseconds, database clock).
    pub next_attempt_at_ms: i64,
    /// The stored arguments (a JSON array).
    pub args: Vec<u8>,
    /// When it was stored (epoch milliseconds, database clock).
    pub created_at_ms: i64,
}

impl CallView {
    /// A row of [`Inspect::call`](crate::Inspect::call) ([`Inspect::CALL`](crate::Inspect::CALL)).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(CallView {
            attempts: u32::try_from(c.i64()?).unwrap_or(0),
            last_error: c.opt_text()?,
            hook_owed: c.i64()? != 0,
            next_attempt_at_ms: c.i64()?,
            args: c.bytes()?,
            created_at_ms: c.i64()?,
        })
    }
}
