//! A ledger row as a claim reads it back, and what a live one answers: what atomic mode's and
//! lease mode's claims decide on.

use idem_core::{Claim, Fingerprint, RecordStatus, Recorded};

use crate::{Column, Decode, Row};

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
