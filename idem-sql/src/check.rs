//! The pre-deploy check of an answer type that changed: decode every live record of a scope
//! as the new type would (with its upcasts), and report the records it cannot read, so a test
//! or deploy job fails before the deploy instead of the retries failing after it.

use std::fmt;

use idem_core::versioned::{AnswerError, AnswerVersion, Versioned};
use idem_core::{Error, RecordStatus};

use crate::driver::connect;
use crate::driver::failed;
use crate::{Decode, Driver, Handle, Row, fetch_each};

/// Records read per statement: the check pages through the scope by id.
const PAGE: i64 = 500;

/// How many unreadable records a report lists (all of them are counted).
pub const MAX_LISTED: usize = 100;

/// What [`check_answers`] (or [`check_final_errors`]) found in one scope.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AnswerCheck {
    /// The scope checked.
    pub scope: String,
    /// The type the records were decoded as.
    pub type_name: &'static str,
    /// The version that type reads ([`Versioned::VERSION`]).
    pub version: u32,
    /// How many live records were decoded.
    pub checked: u64,
    /// How many of them the type cannot read.
    pub failed: u64,
    /// The first [`MAX_LISTED`] of those, in record id order.
    pub failures: Vec<UnreadableRecord>,
}

/// A live record the checked type cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnreadableRecord {
    /// The record id (`idem inspect --id`).
    pub id: Vec<u8>,
    /// The key's hash as the logs print it: the start of the record id.
    pub key_hash: String,
    /// Why it cannot be read: written by a newer version, or not decodable.
    pub error: AnswerError,
}

impl AnswerCheck {
    /// Whether every live record decodes.
    pub fn is_ok(&self) -> bool {
        self.failed == 0
    }
}

impl fmt::Display for AnswerCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            scope,
            type_name,
            version,
            checked,
            failed,
            failures,
        } = self;
        write!(
            f,
            "scope `{scope}`: {failed} of {checked} live records cannot be read as `{type_name}` (version {version})"
        )?;
        for record in failures {
            let id: String = record.id.iter().map(|b| format!("{b:02x}")).collect();
            write!(
                f,
                "\n  key hash {} (record {id}): {}",
                record.key_hash, record.error
            )?;
        }
        if *failed > failures.len() as u64 {
            write!(f, "\n  … and {} more", *failed - failures.len() as u64)?;
        }
        if *failed > 0 {
            write!(
                f,
                "\nbump `idem::Versioned::VERSION` of `{type_name}` and read the recorded shape in its `upcast`, or these retries are answered 410 answer-unreadable until the records expire"
            )?;
        }
        Ok(())
    }
}

/// Decodes every live completed record of `scope` as `T` would read it (its
/// [`Versioned::VERSION`], upcasting older versions) and reports those it cannot read. Run it
/// in a test or deploy job against a copy of production (or production, read-only: it only
/// reads) with the type about to be deployed; a report that is not
/// [`is_ok`](AnswerCheck::is_ok) means retries of those keys would fail after the deploy.
///
/// A type that is not [`Versioned`] yet is checked by implementing it with `VERSION = 1`,
/// which changes nothing it records. Records written by a newer version than `T`'s are
/// reported too (checking the old type before a rollback).
///
/// # Errors
/// [`Error::Store`] when the ledger cannot be read.
pub async fn check_answers<T: Versioned, D: Driver, H: Handle<D>>(
    db: &H,
    scope: &str,
) -> Result<AnswerCheck, Error> {
    check::<T, D, H>(db, scope, RecordStatus::Completed).await
}

/// [`check_answers`] for the final errors a scope recorded
/// ([`FinalError`](idem_core::FinalError)): decodes every live failed record as `E`.
///
/// # Errors
/// [`Error::Store`] when the ledger cannot be read.
pub async fn check_final_errors<E: Versioned, D: Driver, H: Handle<D>>(
    db: &H,
    scope: &str,
) -> Result<AnswerCheck, Error> {
    check::<E, D, H>(db, scope, RecordStatus::Failed).await
}

async fn check<T: Versioned, D: Driver, H: Handle<D>>(
    db: &H,
    scope: &str,
    status: RecordStatus,
) -> Result<AnswerCheck, Error> {
    let doing = "reading the scope's records for the answer check";
    let (mut conn, sql) = connect(db, doing).await?;
    let version = AnswerVersion::of::<T>();
    let mut report = AnswerCheck {
        scope: scope.to_owned(),
        type_name: std::any::type_name::<T>(),
        version: version.version(),
        checked: 0,
        failed: 0,
        failures: Vec::new(),
    };
    let mut after: Vec<u8> = Vec::new();
    loop {
        let page = sql.ledger.live_answers(scope, status.code(), &after, PAGE);
        let rows = fetch_each(&mut conn, page, read_answer)
            .await
            .map_err(|fault| failed::<D>((doing, fault)))?;
        for (id, response) in &rows {
            report.checked += 1;
            if let Err(error) = version.decode::<T>(response.as_deref().unwrap_or_default()) {
                report.failed += 1;
                if report.failures.len() < MAX_LISTED {
                    let key_hash = id.iter().take(8).map(|b| format!("{b:02x}")).collect();
                    report.failures.push(UnreadableRecord {
                        id: id.clone(),
                        key_hash,
                        error,
                    });
                }
            }
            after.clone_from(id);
        }
        if rows.len() < PAGE as usize {
            return Ok(report);
        }
    }
}

/// A row of [`Ledger::live_answers`](crate::Ledger::live_answers): id, response.
fn read_answer(row: Row) -> Result<(Vec<u8>, Option<Vec<u8>>), Decode> {
    let mut c = row.read();
    Ok((c.bytes()?, c.opt_bytes()?))
}

/// Writes a store's `check_answers` and `check_final_errors` on its handles, with the
/// signatures its users call (`check_answers::<Receipt, _>(&db, "orders.pay")`): the
/// functions above also name the driver, which a turbofish would then have to spell.
/// `check_entries!([C: Handle<SeaOrm>] C, SeaOrm)`.
#[doc(hidden)]
#[macro_export]
macro_rules! check_entries {
    ([$($generics:tt)*] $handle:ty, $driver:ty) => {
        /// Decodes every live completed record of `scope` as `T` would read it (its
        /// `Versioned::VERSION`, upcasting older versions) and reports those it cannot read:
        /// run it in a test or deploy job with the type about to be deployed; a report that is
        /// not `is_ok` means retries of those keys would fail after the deploy (see
        /// [`idem_sql::check::check_answers`](::idem_sql::check::check_answers)).
        ///
        /// # Errors
        /// `Error::Store` when the ledger cannot be read.
        pub async fn check_answers<T: ::idem_core::versioned::Versioned, $($generics)*>(
            db: &$handle,
            scope: &str,
        ) -> Result<$crate::check::AnswerCheck, ::idem_core::Error> {
            $crate::check::check_answers::<T, $driver, $handle>(db, scope).await
        }

        /// [`check_answers`] for the final errors a scope recorded (`FinalError`): decodes
        /// every live failed record as `E`.
        ///
        /// # Errors
        /// `Error::Store` when the ledger cannot be read.
        pub async fn check_final_errors<E: ::idem_core::versioned::Versioned, $($generics)*>(
            db: &$handle,
            scope: &str,
        ) -> Result<$crate::check::AnswerCheck, ::idem_core::Error> {
            $crate::check::check_final_errors::<E, $driver, $handle>(db, scope).await
        }
    };
}
