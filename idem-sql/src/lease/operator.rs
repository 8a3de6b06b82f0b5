//! What the operator's lease reads answer, once for every store: leases that ended without
//! their call finishing, and live leases held for long (a hung holder). Each store runs
//! [`Lease::expired_leases`](crate::Lease::expired_leases) and
//! [`Lease::stuck_leases`](crate::Lease::stuck_leases) and builds these from the rows'
//! columns, in the order the statements select them.

use crate::{Column, Decode, Row};

/// A lease that ended without its call finishing (the holder crashed, hung or was dropped): a
/// retry takes it over, and so does a completer when the call is
/// [`resumable`](Self::resumable) and its scope has a resumer; alert on the others.
/// `purge_expired` removes those never taken over with the other expired records.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExpiredLease {
    /// The record id.
    pub id: Vec<u8>,
    /// The handler's scope.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The last holder's fencing token.
    pub token: i64,
    /// How long ago the lease ended (database clock).
    pub ended_ms_ago: i64,
    /// Whether the call is resumable (its arguments are stored): a completer with a resumer
    /// for its scope finishes it. Otherwise only a client retry can.
    pub resumable: bool,
    /// Attempts completers made at it (0 when it is not resumable).
    pub attempts: u32,
}

impl ExpiredLease {
    /// The columns of [`Lease::expired_leases`](crate::Lease::expired_leases), in order.
    pub const COLUMNS: &'static [Column] = &[
        Column::Bytes,
        Column::Text,
        Column::Text,
        Column::I64,
        Column::I64,
        Column::I64,
        Column::I32,
    ];

    /// A row of [`Lease::expired_leases`](crate::Lease::expired_leases)
    /// ([`ExpiredLease::COLUMNS`]).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(Self::from_columns(
            c.bytes()?,
            c.text()?,
            c.text()?,
            c.i64()?,
            c.i64()?,
            c.i64()?,
            c.opt_int()?,
        ))
    }

    /// A row of [`Lease::expired_leases`](crate::Lease::expired_leases): `id, scope, idem_key,
    /// token, expires_at_ms, now_ms, attempts` (`attempts` is `NULL` for a call that is not
    /// resumable).
    pub fn from_columns(
        id: Vec<u8>,
        scope: String,
        key: String,
        token: i64,
        expires_at_ms: i64,
        now_ms: i64,
        attempts: Option<i32>,
    ) -> Self {
        Self {
            id,
            scope,
            key,
            token,
            ended_ms_ago: now_ms - expires_at_ms,
            resumable: attempts.is_some(),
            attempts: attempts.map_or(0, |n| u32::try_from(n).unwrap_or(0)),
        }
    }
}

/// A lease still live whose call has run for longer than a threshold: its holder may be hung
/// (renewals keep a lease alive while the process lives). A store's `release_lease` ends it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StuckLease {
    /// The record id.
    pub id: Vec<u8>,
    /// The handler's scope.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The holder's fencing token.
    pub token: i64,
    /// How long the holder has held it (since its claim or takeover; database clock).
    pub held_ms: i64,
    /// How long until the lease ends unless renewed.
    pub ends_in_ms: i64,
    /// Whether the call is resumable: once released, a completer finishes it.
    pub resumable: bool,
}

impl StuckLease {
    /// The columns of [`Lease::stuck_leases`](crate::Lease::stuck_leases), in order.
    pub const COLUMNS: &'static [Column] = &[
        Column::Bytes,
        Column::Text,
        Column::Text,
        Column::I64,
        Column::I64,
        Column::I64,
        Column::I64,
        Column::I32,
    ];

    /// A row of [`Lease::stuck_leases`](crate::Lease::stuck_leases)
    /// ([`StuckLease::COLUMNS`]).
    pub fn from_row(row: Row) -> Result<Self, Decode> {
        let mut c = row.read();
        Ok(Self::from_columns(
            c.bytes()?,
            c.text()?,
            c.text()?,
            c.i64()?,
            c.i64()?,
            c.i64()?,
            c.i64()?,
            c.opt_int()?,
        ))
    }

    /// A row of [`Lease::stuck_leases`](crate::Lease::stuck_leases): `id, scope, idem_key,
    /// token, created_at_ms, expires_at_ms, now_ms, attempts`.
    #[allow(clippy::too_many_arguments)] // one per selected column, in their order
    pub fn from_columns(
        id: Vec<u8>,
        scope: String,
        key: String,
        token: i64,
        created_at_ms: i64,
        expires_at_ms: i64,
        now_ms: i64,
        attempts: Option<i32>,
    ) -> Self {
        Self {
            id,
            scope,
            key,
            token,
            held_ms: now_ms - created_at_ms,
            ends_in_ms: expires_at_ms - now_ms,
            resumable: attempts.is_some(),
        }
    }
}
