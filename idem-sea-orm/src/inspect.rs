//! Read-only views of the ledger for operators and admin tools (the `idem` command-line tool
//! is built on them): one record with its recorded steps and stored call, the records whose id
//! starts with a prefix (logs print the first 16 hex digits of a record's id as `key_hash`), a
//! scope's recent records, and which of idem's tables a database lacks. Nothing here writes.

use std::time::Duration;

use idem_core::{Error, RecordStatus};
use sea_orm::{
    AccessMode, ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr,
    IsolationLevel, QueryResult, TransactionTrait,
};

use crate::driver::error::store_error;
use crate::driver::statement;
use crate::driver::{ALL_TABLES, CALLS_TABLE, STEPS_TABLE};
use crate::ledger;

/// One ledger record as it stands, read in one snapshot: the row, the steps of a call in
/// progress, and its stored call if it is resumable.
///
/// idem does not count replays: a replay reads the record and writes nothing, so how often a
/// key was answered from the ledger is not stored anywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordView {
    /// The ledger row, as the [`ledger`] entity has it (the one row type, from
    /// the store to this view).
    pub record: ledger::Model,
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

/// A resumable call's stored call: what a [`Completer`](crate::Completer) works from.
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

/// Those of idem's tables (the ledger, steps, calls and outbox tables) that `db` does not
/// have, as idem's own statements would look them up (on PostgreSQL, through the search
/// path). Empty when [`create_tables`](crate::create_tables) or the migrations have run.
pub async fn missing_tables<C: ConnectionTrait>(db: &C) -> Result<Vec<&'static str>, Error> {
    let existing = existing_tables(db)
        .await
        .map_err(|e| store_error("listing idem's tables", e))?;
    Ok(ALL_TABLES
        .into_iter()
        .filter(|table| !existing.iter().any(|name| name == table))
        .collect())
}

async fn existing_tables<C: ConnectionTrait>(db: &C) -> Result<Vec<String>, DbErr> {
    let sql = crate::driver::of(db.get_database_backend());
    db.query_all_raw(statement(sql, sql.inspect.existing_tables()))
        .await?
        .iter()
        .map(|row| row.try_get_by_index(0))
        .collect()
}

/// The record `id` (see `idem::store::record_id`), with its steps and stored call, read in
/// one read-only snapshot; `None` if there is none (never claimed, or purged). Databases
/// made before lease mode or the completer, without the steps or calls table, show none.
pub async fn record(db: &DatabaseConnection, id: &[u8]) -> Result<Option<RecordView>, Error> {
    let doing = "reading a ledger record";
    let tx = match db.get_database_backend() {
        // SQLite reads one snapshot from a transaction's first read, and has no access modes.
        DbBackend::Sqlite => db.begin().await,
        _ => {
            db.begin_with_config(
                Some(IsolationLevel::RepeatableRead),
                Some(AccessMode::ReadOnly),
            )
            .await
        }
    }
    .map_err(|e| store_error(doing, e))?;
    let read = read_record(&tx, id).await;
    // Nothing was written: ending the snapshot either way is the same.
    let _ = tx.rollback().await;
    read.map_err(|e| store_error(doing, e))
}

async fn read_record(tx: &DatabaseTransaction, id: &[u8]) -> Result<Option<RecordView>, DbErr> {
    let sql = crate::driver::of(tx.get_database_backend());
    let Some(row) = tx
        .query_one_raw(statement(sql, sql.inspect.record(id)))
        .await?
    else {
        return Ok(None);
    };
    let mut record = read_record_row(&row)?;
    let existing = existing_tables(tx).await?;
    let exists = |table: &str| existing.iter().any(|name| name == table);
    if exists(STEPS_TABLE) {
        record.steps = tx
            .query_all_raw(statement(sql, sql.inspect.steps(id)))
            .await?
            .iter()
            .map(|row| {
                let (name, token, value, created_at_ms) = row.try_get_many_by_index()?;
                Ok(StepView {
                    name,
                    token,
                    value,
                    created_at_ms,
                })
            })
            .collect::<Result<_, DbErr>>()?;
    }
    if exists(CALLS_TABLE)
        && let Some(row) = tx
            .query_one_raw(statement(sql, sql.inspect.call(id)))
            .await?
    {
        let (attempts, last_error, gave_up, next_attempt_at_ms, args, created_at_ms) =
            row.try_get_many_by_index::<(i32, _, i16, _, _, _)>()?;
        record.call = Some(CallView {
            attempts: u32::try_from(attempts).unwrap_or(0),
            last_error,
            hook_owed: gave_up != 0,
            next_attempt_at_ms,
            args,
            created_at_ms,
        });
    }
    Ok(Some(record))
}

/// The start of a record id, as an operator copies it from a log line (`key_hash`, 16 hex
/// digits) or from `idem leases` (64): 1 to 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdPrefix {
    /// The lowest id the prefix covers (the prefix, then zeros).
    low: [u8; 32],
    /// The highest id it covers (the prefix, then ones).
    high: [u8; 32],
    /// The digits, lowercase.
    digits: String,
}

impl std::fmt::Display for IdPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.digits)
    }
}

impl IdPrefix {
    /// Parses 1 to 64 hex digits (either case; surrounding blanks ignored).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() || text.len() > 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "a record id is 1 to 64 hex digits (the `key_hash` of a log line, or the id \
                `idem leases` prints), not `{text}`"
            ));
        }
        let (mut low, mut high) = ([0u8; 32], [0xffu8; 32]);
        for (i, digit) in text.bytes().enumerate() {
            // Checked above: every byte is a hex digit.
            let nibble = (digit as char).to_digit(16).unwrap_or(0) as u8;
            let (byte, shift) = (i / 2, if i % 2 == 0 { 4 } else { 0 });
            low[byte] = (low[byte] & !(0xf << shift)) | (nibble << shift);
            high[byte] = (high[byte] & !(0xf << shift)) | (nibble << shift);
        }
        Ok(Self {
            low,
            high,
            digits: text.to_ascii_lowercase(),
        })
    }

    /// The whole id, when the prefix has all 64 digits.
    pub fn whole(&self) -> Option<[u8; 32]> {
        (self.digits.len() == 64).then_some(self.low)
    }
}

/// The ids of up to `limit` records whose id starts with `prefix`, in order: one when the
/// prefix is unique, none when no record has it. A range read of the primary key.
pub async fn ids_with_prefix(
    db: &DatabaseConnection,
    prefix: &IdPrefix,
    limit: u32,
) -> Result<Vec<Vec<u8>>, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let range = sql
        .inspect
        .ids_in_range(&prefix.low, &prefix.high, i64::from(limit));
    db.query_all_raw(statement(sql, range))
        .await
        .and_then(|rows| rows.iter().map(|row| row.try_get_by_index(0)).collect())
        .map_err(|e| store_error("looking up record ids by their first digits", e))
}

/// Up to `limit` records of `scope` claimed within `since` of the database's now, newest
/// first, in `status` only if given; without their steps and stored calls (see [`record`]).
///
/// No index leads with the scope, so this reads the whole ledger table: for an operator's
/// occasional look, not for a service's requests.
pub async fn recent_records(
    db: &DatabaseConnection,
    scope: &str,
    since: Duration,
    status: Option<RecordStatus>,
    limit: u32,
) -> Result<Vec<RecordView>, Error> {
    let sql = crate::driver::of(db.get_database_backend());
    let since_ms = i64::try_from(since.as_millis()).unwrap_or(i64::MAX);
    let list = sql.inspect.list_records(
        scope,
        since_ms,
        status.map(RecordStatus::code),
        i64::from(limit),
    );
    db.query_all_raw(statement(sql, list))
        .await
        .and_then(|rows| rows.iter().map(read_record_row).collect())
        .map_err(|e| store_error("listing a scope's recent records", e))
}

fn read_record_row(row: &QueryResult) -> Result<RecordView, DbErr> {
    Ok(RecordView {
        record: ledger::Model {
            id: row.try_get_by_index(0)?,
            scope: row.try_get_by_index(1)?,
            principal: row.try_get_by_index(2)?,
            idem_key: row.try_get_by_index(3)?,
            owner: row.try_get_by_index(4)?,
            fingerprint: row.try_get_by_index(5)?,
            state: row.try_get_by_index(6)?,
            response: row.try_get_by_index(7)?,
            created_at_ms: row.try_get_by_index(8)?,
            expires_at_ms: row.try_get_by_index(9)?,
        },
        now_ms: row.try_get_by_index(10)?,
        steps: Vec::new(),
        call: None,
    })
}

#[cfg(test)]
mod tests {
    use sea_orm::Database;

    use super::*;

    #[tokio::test]
    async fn a_fresh_database_lacks_every_table_until_create_tables() {
        let db = Database::connect("sqlite::memory:").await.expect("db");
        assert_eq!(
            missing_tables(&db).await.expect("list"),
            ALL_TABLES.to_vec()
        );
        crate::create_tables(&db).await.expect("tables");
        assert_eq!(missing_tables(&db).await.expect("list"), Vec::<&str>::new());
        assert_eq!(record(&db, &[7; 32]).await.expect("read"), None);
    }

    #[test]
    fn a_prefix_covers_the_ids_that_start_with_it() {
        let odd = IdPrefix::parse("7Fa").expect("three digits");
        assert_eq!(&odd.low[..3], &[0x7f, 0xa0, 0]);
        assert_eq!(&odd.high[..3], &[0x7f, 0xaf, 0xff]);
        assert_eq!(odd.whole(), None);
        let whole = "ab".repeat(32);
        assert_eq!(
            IdPrefix::parse(&whole).expect("64").whole(),
            Some([0xab; 32])
        );
        for bad in ["", "xyz", &"a".repeat(65), "12 34"] {
            let refused = IdPrefix::parse(bad).expect_err(bad);
            assert!(refused.contains("1 to 64 hex digits"), "{refused}");
        }
    }
}
