//! Read-only views of the ledger for operators and admin tools (the `idem` command-line tool
//! is built on them), on any driver's [`Handle`]: one record with its recorded steps and
//! stored call, the records whose id starts with a prefix (logs print the first 16 hex digits
//! of a record's id as `key_hash`), a scope's recent records, and which of idem's tables a
//! database lacks. Nothing here writes.

mod prefix;
pub(crate) mod statements;
mod view;

use std::time::Duration;

use idem_core::{Error, RecordStatus};

pub use prefix::IdPrefix;
pub use view::{CallView, LedgerRow, RecordView, StepView};

use crate::driver::connect;
use crate::driver::{db_error, failed};
use crate::names::ALL_TABLES;
use crate::{
    Begin, CALLS_TABLE, Connection, Driver, Fault, Handle, Row, STEPS_TABLE, Sql, Transaction,
    fetch_each, fetch_first,
};

/// Those of idem's tables (the ledger, steps, calls and outbox tables) that `db` does not
/// have, as idem's own statements would look them up (on PostgreSQL, through the search
/// path). Empty when `create_tables` or the migrations have run.
pub async fn missing_tables<D: Driver, H: Handle<D>>(db: &H) -> Result<Vec<&'static str>, Error> {
    let doing = "listing idem's tables";
    let (mut conn, sql) = connect(db, doing).await?;
    let existing = existing_tables(&mut conn, sql)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))?;
    Ok(ALL_TABLES
        .into_iter()
        .filter(|table| !existing.iter().any(|name| name == table))
        .collect())
}

/// The names of those of idem's tables `conn` sees.
pub(crate) async fn existing_tables<C: Connection>(
    conn: &mut C,
    sql: &'static Sql,
) -> Result<Vec<String>, Fault<C::Error>> {
    fetch_each(conn, sql.inspect.existing_tables(), Row::into_text).await
}

/// The record `id` (see `idem::store::record_id`), with its steps and stored call, read in
/// one read-only snapshot of a pool (in a transaction `db` holds, in it); `None` if there is
/// none (never claimed, or purged). Databases made before lease mode or the completer,
/// without the steps or calls table, show none.
pub async fn record<D: Driver, H: Handle<D>>(
    db: &H,
    id: &[u8],
) -> Result<Option<RecordView>, Error> {
    let doing = "reading a ledger record";
    let Some(driver) = db.driver() else {
        let (mut conn, sql) = connect(db, doing).await?;
        let read = read_record(&mut conn, sql, id).await;
        return read.map_err(|fault| failed::<D>((doing, fault)));
    };
    let mut tx = driver
        .begin(Begin::Snapshot)
        .await
        .map_err(|e| db_error::<D>(doing, e))?;
    let read = read_record(&mut tx, Sql::common(db.dialect()), id).await;
    // Nothing was written: ending the snapshot either way is the same.
    let _ = tx.rollback().await;
    read.map_err(|fault| failed::<D>((doing, fault)))
}

async fn read_record<C: Connection>(
    conn: &mut C,
    sql: &'static Sql,
    id: &[u8],
) -> Result<Option<RecordView>, Fault<C::Error>> {
    let Some(mut record) = fetch_first(conn, sql.inspect.record(id), RecordView::from_row).await?
    else {
        return Ok(None);
    };
    let existing = existing_tables(conn, sql).await?;
    let exists = |table: &str| existing.iter().any(|name| name == table);
    if exists(STEPS_TABLE) {
        record.steps = fetch_each(conn, sql.inspect.steps(id), StepView::from_row).await?;
    }
    if exists(CALLS_TABLE) {
        record.call = fetch_first(conn, sql.inspect.call(id), CallView::from_row).await?;
    }
    Ok(Some(record))
}

/// The ids of up to `limit` records whose id starts with `prefix`, in order: one when the
/// prefix is unique, none when no record has it. A range read of the primary key.
pub async fn ids_with_prefix<D: Driver, H: Handle<D>>(
    db: &H,
    prefix: &IdPrefix,
    limit: u32,
) -> Result<Vec<Vec<u8>>, Error> {
    let doing = "looking up record ids by their first digits";
    let (mut conn, sql) = connect(db, doing).await?;
    let range = sql
        .inspect
        .ids_in_range(&prefix.low, &prefix.high, i64::from(limit));
    fetch_each(&mut conn, range, Row::into_bytes)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))
}

/// Up to `limit` records of `scope` claimed within `since` of the database's now, newest
/// first, in `status` only if given; without their steps and stored calls (see [`record`]).
///
/// No index leads with the scope, so this reads the whole ledger table: for an operator's
/// occasional look, not for a service's requests.
pub async fn recent_records<D: Driver, H: Handle<D>>(
    db: &H,
    scope: &str,
    since: Duration,
    status: Option<RecordStatus>,
    limit: u32,
) -> Result<Vec<RecordView>, Error> {
    let doing = "listing a scope's recent records";
    let (mut conn, sql) = connect(db, doing).await?;
    let list = sql.inspect.list_records(
        scope,
        i64::try_from(since.as_millis()).unwrap_or(i64::MAX),
        status.map(RecordStatus::code),
        i64::from(limit),
    );
    fetch_each(&mut conn, list, RecordView::from_row)
        .await
        .map_err(|fault| failed::<D>((doing, fault)))
}
