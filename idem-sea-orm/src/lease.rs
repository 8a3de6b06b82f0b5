//! Lease mode on the SeaORM ledger: the lease is the ledger row itself (state in progress,
//! `owner` = the fencing token, `expires_at_ms` = the lease end while in progress), and
//! recovery points live in `idem_steps`. Every write of a holder locks the ledger row and checks
//! its token first, so a holder whose lease was taken over cannot record anything.

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::time::Duration;

use idem_core::ids::random_token;
use idem_core::lease::LeaseHandle;
use idem_core::{
    BoxFuture, Error, LeaseClaim, LeaseStore, RecordStatus, Recorded, Request, Ticket,
};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, DbErr, Statement, Value,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::dialect::{Dialect, LEDGER_TABLE, MYSQL_NOW, PG_NOW, SQLITE_NOW, millis, render};
use crate::error::store_error;
use crate::store::{begin, detached, ledger_row, read_row, statement};

/// Name of the table of recorded steps (recovery points) of calls in progress.
pub const STEPS_TABLE: &str = "idem_steps";

/// The lease statements of one backend (the claim reuses the ledger's own statements).
struct LeaseSql {
    create: Vec<String>,
    /// Binds record_id.
    select_steps: String,
    /// Binds record_id, name, token, result.
    insert_step: String,
    /// Binds record_id.
    delete_steps: String,
    /// Binds lease_ms, id, token.
    renew: String,
    /// Binds state, response, ttl_ms, id, token.
    complete: String,
    /// Binds id, token.
    release: String,
    /// Returns id, scope, idem_key, owner, expires_at_ms, now_ms of leases that ended.
    expired: String,
    /// Deletes the steps of records that no longer exist (purged).
    purge_orphans: String,
}

fn lease_sql(backend: DbBackend) -> &'static LeaseSql {
    static PG: LazyLock<LeaseSql> = LazyLock::new(|| build(DbBackend::Postgres));
    static MY: LazyLock<LeaseSql> = LazyLock::new(|| build(DbBackend::MySql));
    static LITE: LazyLock<LeaseSql> = LazyLock::new(|| build(DbBackend::Sqlite));
    match backend {
        DbBackend::Postgres => &PG,
        DbBackend::MySql => &MY,
        _ => &LITE,
    }
}

fn build(backend: DbBackend) -> LeaseSql {
    let now = match backend {
        DbBackend::Postgres => PG_NOW,
        DbBackend::MySql => MYSQL_NOW,
        _ => SQLITE_NOW,
    };
    let r = |t: &str| {
        let t = t
            .replace("{steps}", STEPS_TABLE)
            .replace("{ledger}", LEDGER_TABLE);
        render(&t, now, backend)
    };
    let create = match backend {
        DbBackend::Postgres => {
            "CREATE TABLE IF NOT EXISTS {steps} (\
            record_id BYTEA NOT NULL, name VARCHAR(255) NOT NULL, token BIGINT NOT NULL, \
            result BYTEA NOT NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (record_id, name))"
        }
        DbBackend::MySql => {
            "CREATE TABLE IF NOT EXISTS {steps} (\
            record_id BINARY(32) NOT NULL, name VARCHAR(255) NOT NULL, token BIGINT NOT NULL, \
            result LONGBLOB NOT NULL, created_at_ms BIGINT NOT NULL, PRIMARY KEY (record_id, name)\
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        }
        _ => {
            "CREATE TABLE IF NOT EXISTS {steps} (\
            record_id BLOB NOT NULL, name TEXT NOT NULL, token INTEGER NOT NULL, \
            result BLOB NOT NULL, created_at_ms INTEGER NOT NULL, PRIMARY KEY (record_id, name)\
            ) WITHOUT ROWID"
        }
    };
    let insert = "INSERT INTO {steps} (record_id, name, token, result, created_at_ms) \
        VALUES (?, ?, ?, ?, {now})";
    let insert_step = match backend {
        DbBackend::MySql => format!(
            "{insert} ON DUPLICATE KEY UPDATE token = VALUES(token), result = VALUES(result)"
        ),
        _ => format!(
            "{insert} ON CONFLICT (record_id, name) DO UPDATE SET token = excluded.token, result = excluded.result"
        ),
    };
    LeaseSql {
        create: vec![r(create)],
        select_steps: r("SELECT name, result FROM {steps} WHERE record_id = ?"),
        insert_step: r(&insert_step),
        delete_steps: r("DELETE FROM {steps} WHERE record_id = ?"),
        renew: r("UPDATE {ledger} SET expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = 0"),
        complete: r(
            "UPDATE {ledger} SET state = ?, response = ?, expires_at_ms = {now} + ? \
            WHERE id = ? AND owner = ? AND state = 0",
        ),
        release: r("UPDATE {ledger} SET expires_at_ms = {now} \
            WHERE id = ? AND owner = ? AND state = 0"),
        expired: r(
            "SELECT id, scope, idem_key, owner, expires_at_ms, {now} AS now_ms FROM {ledger} \
            WHERE state = 0 AND expires_at_ms <= {now} ORDER BY expires_at_ms LIMIT ?",
        ),
        purge_orphans: r("DELETE FROM {steps} WHERE record_id NOT IN (SELECT id FROM {ledger})"),
    }
}

/// Creates the steps table. [`crate::create_tables`] calls it.
pub(crate) async fn create_lease_tables<C: ConnectionTrait>(db: &C) -> Result<(), Error> {
    for sql in &lease_sql(db.get_database_backend()).create {
        db.execute_unprepared(sql)
            .await
            .map_err(|e| store_error("creating the steps table", e))?;
    }
    Ok(())
}

/// The DDL of the steps table, for the migration: (up, down).
#[cfg_attr(not(feature = "migration"), allow(dead_code))]
pub(crate) fn lease_ddl(backend: DbBackend) -> (&'static [String], String) {
    (
        &lease_sql(backend).create,
        format!("DROP TABLE IF EXISTS {STEPS_TABLE}"),
    )
}

/// The ledger in lease mode on a SeaORM connection; `#[idempotent(..., lease = "…")]` builds
/// one from the handler's connection.
#[derive(Debug, Clone)]
pub struct SeaOrmLeaseStore {
    db: DatabaseConnection,
}

impl SeaOrmLeaseStore {
    /// A lease store on `db` (cloning a connection shares its pool).
    pub fn new(db: DatabaseConnection) -> Self {
        Self { db }
    }
}

/// Locks the ledger row of `ticket` in `tx` and checks the ticket still holds it.
async fn fence(tx: &DatabaseTransaction, ticket: &Ticket, scope: &str) -> Result<(), Error> {
    let d = Dialect::of(tx.get_database_backend());
    let row = tx
        .query_one_raw(statement(
            d,
            &d.read_locked,
            vec![ticket.id.to_vec().into()],
        ))
        .await
        .map_err(|e| store_error("checking the lease", e))?;
    let holds = match row {
        Some(row) => {
            let row = read_row(&row).map_err(|e| store_error("checking the lease", e))?;
            row.owner == ticket.token && row.status == Some(RecordStatus::Pending)
        }
        None => false,
    };
    if holds {
        Ok(())
    } else {
        Err(Error::LeaseLost {
            scope: scope.to_owned(),
        })
    }
}

async fn insert_step(
    tx: &DatabaseTransaction,
    ticket: &Ticket,
    name: &str,
    payload: &[u8],
) -> Result<(), Error> {
    let sql = lease_sql(tx.get_database_backend());
    tx.execute_raw(Statement::from_sql_and_values(
        tx.get_database_backend(),
        &sql.insert_step,
        [
            ticket.id.to_vec().into(),
            name.into(),
            ticket.token.into(),
            payload.to_vec().into(),
        ],
    ))
    .await
    .map(drop)
    .map_err(|e| store_error("recording a step", e))
}

async fn claim(
    db: DatabaseConnection,
    values: Vec<Value>,
    id: [u8; 32],
    owner: i64,
    fingerprint: idem_core::Fingerprint,
    lease_ms: i64,
) -> Result<LeaseClaim, Error> {
    let d = Dialect::of(db.get_database_backend());
    let doing = "claiming a lease";
    let tx = begin(&db).await.map_err(|e| store_error(doing, e))?;
    let failed = |e: DbErr| store_error(doing, e);
    // Inserted only if absent; then read the row back, locked, with the database's clock.
    tx.execute_raw(statement(d, &d.claim, values))
        .await
        .map_err(failed)?;
    let row = tx
        .query_one_raw(statement(d, &d.read_locked, vec![id.to_vec().into()]))
        .await
        .map_err(failed)?
        .ok_or_else(|| Error::store(doing, "the claimed ledger row is missing"))?;
    let row = read_row(&row).map_err(failed)?;
    let ticket = |token: i64, now_ms: i64| Ticket::new(id, token, now_ms + lease_ms);
    if row.owner == owner {
        tx.commit().await.map_err(failed)?;
        return Ok(LeaseClaim::Execute {
            ticket: ticket(owner, row.now_ms),
            steps: Vec::new(),
        });
    }
    let live = row.expires_at_ms > row.now_ms;
    let answer = match row.status {
        _ if row.fingerprint != fingerprint
            && (live || row.status == Some(RecordStatus::Pending)) =>
        {
            // Another payload under this key: the engine answers KeyReused.
            LeaseClaim::Recorded(Recorded {
                fingerprint: row.fingerprint,
                status: row.status.unwrap_or(RecordStatus::Pending),
                payload: Vec::new(),
            })
        }
        Some(RecordStatus::Pending) if live => LeaseClaim::InFlight {
            retry_after: Duration::from_millis(
                u64::try_from(row.expires_at_ms - row.now_ms).unwrap_or(0),
            ),
        },
        Some(RecordStatus::Completed | RecordStatus::Failed) if live => {
            LeaseClaim::Recorded(Recorded {
                fingerprint: row.fingerprint,
                status: row.status.unwrap_or(RecordStatus::Completed),
                payload: row.response.unwrap_or_default(),
            })
        }
        Some(RecordStatus::Pending) => {
            // The holder's lease ended: take over with the next token, resume after its steps.
            let token = row.owner.wrapping_add(1);
            take_over(&tx, d, token, fingerprint, lease_ms, &id).await?;
            let sql = lease_sql(d.backend);
            let steps = tx
                .query_all_raw(statement(d, &sql.select_steps, vec![id.to_vec().into()]))
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| Ok((r.try_get_by_index(0)?, r.try_get_by_index(1)?)))
                        .collect::<Result<Vec<(String, Vec<u8>)>, DbErr>>()
                })
                .map_err(failed)?;
            LeaseClaim::Execute {
                ticket: ticket(token, row.now_ms),
                steps,
            }
        }
        _ => {
            // An expired record (or an unknown state): a new execution.
            take_over(&tx, d, owner, fingerprint, lease_ms, &id).await?;
            let sql = lease_sql(d.backend);
            tx.execute_raw(statement(d, &sql.delete_steps, vec![id.to_vec().into()]))
                .await
                .map_err(failed)?;
            LeaseClaim::Execute {
                ticket: ticket(owner, row.now_ms),
                steps: Vec::new(),
            }
        }
    };
    tx.commit().await.map_err(failed)?;
    Ok(answer)
}

async fn take_over(
    tx: &DatabaseTransaction,
    d: &Dialect,
    owner: i64,
    fingerprint: idem_core::Fingerprint,
    lease_ms: i64,
    id: &[u8],
) -> Result<(), Error> {
    tx.execute_raw(statement(
        d,
        &d.take_over,
        vec![
            owner.into(),
            fingerprint.0.to_vec().into(),
            lease_ms.into(),
            id.to_vec().into(),
        ],
    ))
    .await
    .map(drop)
    .map_err(|e| store_error("taking over a lease", e))
}

/// Runs `update` (binds as given) and reports whether it changed the held record.
async fn fenced_update(
    db: &DatabaseConnection,
    sql: &str,
    values: Vec<Value>,
    doing: &'static str,
) -> Result<bool, Error> {
    db.execute_raw(Statement::from_sql_and_values(
        db.get_database_backend(),
        sql,
        values,
    ))
    .await
    .map(|r| r.rows_affected() == 1)
    .map_err(|e| store_error(doing, e))
}

fn lost() -> Error {
    // The scope is not known here; the engine's span carries it.
    Error::LeaseLost {
        scope: String::new(),
    }
}

impl LeaseStore for SeaOrmLeaseStore {
    fn claim_lease<'a>(
        &'a self,
        req: &'a Request,
        lease: Duration,
    ) -> BoxFuture<'a, Result<LeaseClaim, Error>> {
        let owner = random_token();
        let step = claim(
            self.db.clone(),
            ledger_row(req, owner, lease),
            *req.id(),
            owner,
            req.fingerprint(),
            millis(lease),
        );
        Box::pin(detached(step))
    }

    fn renew<'a>(
        &'a self,
        ticket: &'a Ticket,
        lease: Duration,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let sql = &lease_sql(self.db.get_database_backend()).renew;
        let values = vec![
            millis(lease).into(),
            ticket.id.to_vec().into(),
            ticket.token.into(),
        ];
        let db = self.db.clone();
        Box::pin(detached(async move {
            if fenced_update(&db, sql, values, "renewing a lease").await? {
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
        let (db, ticket, name, payload) =
            (self.db.clone(), *ticket, name.to_owned(), payload.to_vec());
        Box::pin(detached(async move {
            let tx = begin(&db)
                .await
                .map_err(|e| store_error("recording a step", e))?;
            fence(&tx, &ticket, "").await?;
            insert_step(&tx, &ticket, &name, &payload).await?;
            tx.commit()
                .await
                .map_err(|e| store_error("recording a step", e))
        }))
    }

    fn complete<'a>(
        &'a self,
        ticket: &'a Ticket,
        req: &'a Request,
        status: RecordStatus,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), Error>> {
        let (db, ticket, payload, ttl) = (self.db.clone(), *ticket, payload.to_vec(), req.ttl());
        Box::pin(detached(async move {
            let doing = "recording the result";
            let sql = lease_sql(db.get_database_backend());
            let tx = begin(&db).await.map_err(|e| store_error(doing, e))?;
            let updated = tx
                .execute_raw(Statement::from_sql_and_values(
                    db.get_database_backend(),
                    &sql.complete,
                    [
                        status.code().into(),
                        payload.into(),
                        millis(ttl).into(),
                        ticket.id.to_vec().into(),
                        ticket.token.into(),
                    ],
                ))
                .await
                .map_err(|e| store_error(doing, e))?;
            if updated.rows_affected() != 1 {
                return Err(lost());
            }
            tx.execute_raw(Statement::from_sql_and_values(
                db.get_database_backend(),
                &sql.delete_steps,
                [ticket.id.to_vec().into()],
            ))
            .await
            .map_err(|e| store_error(doing, e))?;
            tx.commit().await.map_err(|e| store_error(doing, e))
        }))
    }

    fn release_lease<'a>(&'a self, ticket: &'a Ticket) -> BoxFuture<'a, Result<(), Error>> {
        let sql = &lease_sql(self.db.get_database_backend()).release;
        let values = vec![ticket.id.to_vec().into(), ticket.token.into()];
        let db = self.db.clone();
        Box::pin(detached(async move {
            fenced_update(&db, sql, values, "ending a lease")
                .await
                .map(drop)
        }))
    }
}

/// The final phase of a lease-mode handler: runs `writes` in one transaction that also checks
/// the lease and records the step `name`, so the database effects (the guarded transition,
/// the payment row, an outbox message) commit exactly once even across takeovers. A takeover
/// that finds the step recorded returns its value without running `writes` again. A holder
/// that lost its lease gets [`Error::LeaseLost`] and its writes roll back.
///
/// ```text
/// let view = idem::sea_orm::final_step(db, "record-payment", |tx| Box::pin(async move {
///     order::Entity::apply_transition(tx, id, transition!(OrderStatus: Pending -> Paid)).await?;
///     payment::Entity::insert(..).exec(tx).await?;
///     Ok(view)
/// })).await?;
/// ```
pub async fn final_step<T, E, F>(db: &DatabaseConnection, name: &str, writes: F) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<Error>,
    F: for<'t> FnOnce(
        &'t DatabaseTransaction,
    ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>,
{
    let lease = LeaseHandle::current("idem::sea_orm::final_step")?;
    if let Some(value) = lease.recorded::<T>(name)? {
        return Ok(value);
    }
    if lease.is_lost() {
        return Err(lease.lose().into());
    }
    let ticket = lease.ticket();
    let tx = begin(db)
        .await
        .map_err(|e| store_error("beginning the final phase", e))?;
    if let Err(e) = fence(&tx, &ticket, "").await {
        let _ = tx.rollback().await;
        return Err(if e.kind() == idem_core::ErrorKind::LeaseLost {
            lease.lose()
        } else {
            e
        }
        .into());
    }
    let value = match writes(&tx).await {
        Ok(value) => value,
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(e);
        }
    };
    let payload = lease.encode(&value)?;
    insert_step(&tx, &ticket, name, &payload).await?;
    tx.commit()
        .await
        .map_err(|e| store_error("committing the final phase", e))?;
    lease.note_recorded(name, payload);
    Ok(value)
}

/// A lease that ended without its call finishing (the holder crashed, hung or was dropped):
/// alert on these; a retry takes it over, and `purge_expired` removes it with the other
/// expired records.
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
}

/// Lists up to `limit` leases that ended without their call finishing, oldest first.
pub async fn expired_leases<C: ConnectionTrait>(
    db: &C,
    limit: u32,
) -> Result<Vec<ExpiredLease>, Error> {
    let sql = lease_sql(db.get_database_backend());
    let doing = "listing expired leases";
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            db.get_database_backend(),
            &sql.expired,
            [i64::from(limit).into()],
        ))
        .await
        .map_err(|e| store_error(doing, e))?;
    rows.iter()
        .map(|r| {
            let expires: i64 = r.try_get_by_index(4)?;
            let now: i64 = r.try_get_by_index(5)?;
            Ok(ExpiredLease {
                id: r.try_get_by_index(0)?,
                scope: r.try_get_by_index(1)?,
                key: r.try_get_by_index(2)?,
                token: r.try_get_by_index(3)?,
                ended_ms_ago: now - expires,
            })
        })
        .collect::<Result<_, DbErr>>()
        .map_err(|e| store_error(doing, e))
}

/// Deletes the steps of records `purge_expired` removed (leases that ended and were never
/// taken over). The steps table only holds calls in progress, so this stays small.
pub(crate) async fn purge_orphaned_steps<C: ConnectionTrait>(db: &C) -> Result<u64, Error> {
    let sql = lease_sql(db.get_database_backend());
    db.execute_unprepared(&sql.purge_orphans)
        .await
        .map(|r| r.rows_affected())
        .map_err(|e| store_error("purging the steps of purged records", e))
}
