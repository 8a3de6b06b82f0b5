//! The SeaORM [`Store`]: the claim, record and release steps on a [`DatabaseConnection`].

use idem_core::{
    Claim, ClaimRequest, Concurrency, Error, Fingerprint, RecordStatus, Recorded, Store,
};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbBackend, QueryResult,
    SqliteTransactionMode, Statement, TransactionOptions, TransactionTrait, Value,
};

use crate::dialect::Dialect;
use crate::error::{Failure, classify, store_error};

const SAVEPOINT: &str = "SAVEPOINT idem_claim";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idem_claim";

/// The ledger on a SeaORM connection (SQLite, PostgreSQL, MySQL/MariaDB).
///
/// `#[idempotent]` builds one from the handler's `&DatabaseConnection`; you rarely name it.
/// The handler's body runs in the claim's [`DatabaseTransaction`], so the claim, the body's
/// writes and the recorded result commit together or not at all.
#[derive(Debug, Clone, Copy)]
pub struct SeaOrmStore<'c> {
    db: &'c DatabaseConnection,
}

impl<'c> SeaOrmStore<'c> {
    /// A store on `db`. The ledger table must exist ([`crate::create_tables`]).
    pub fn new(db: &'c DatabaseConnection) -> Self {
        Self { db }
    }

    fn dialect(&self) -> &'static Dialect {
        Dialect::of(self.db.get_database_backend())
    }
}

fn statement(dialect: &Dialect, sql: &str, values: Vec<Value>) -> Statement {
    Statement::from_sql_and_values(dialect.backend, sql, values)
}

fn ttl_ms(req: &ClaimRequest<'_>) -> i64 {
    i64::try_from(req.ttl.as_millis()).unwrap_or(i64::MAX / 2)
}

pub(crate) async fn begin(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    match db.get_database_backend() {
        // Take SQLite's write lock up front: a deferred transaction that reads and then writes
        // fails with SQLITE_BUSY instead of waiting.
        DbBackend::Sqlite => {
            db.begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..TransactionOptions::default()
            })
            .await
        }
        // PostgreSQL stays at READ COMMITTED (REPEATABLE READ turns the race into 40001);
        // MySQL's REPEATABLE READ is fine because the claim reads with FOR UPDATE.
        _ => db.begin().await,
    }
}

use sea_orm::DbErr;

struct Row {
    owner: i64,
    fingerprint: Fingerprint,
    status: Option<RecordStatus>,
    response: Option<Vec<u8>>,
    expires_at_ms: i64,
    now_ms: i64,
}

fn read_row(row: &QueryResult) -> Result<Row, DbErr> {
    let fingerprint: Vec<u8> = row.try_get_by_index(1)?;
    let state: i16 = row.try_get_by_index(2)?;
    Ok(Row {
        owner: row.try_get_by_index(0)?,
        fingerprint: Fingerprint(fingerprint.try_into().unwrap_or([0; 32])),
        status: RecordStatus::from_code(state),
        response: row.try_get_by_index(3)?,
        expires_at_ms: row.try_get_by_index(4)?,
        now_ms: row.try_get_by_index(5)?,
    })
}

impl Store for SeaOrmStore<'_> {
    type Tx = DatabaseTransaction;

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<DatabaseTransaction>, Error> {
        let d = self.dialect();
        let tx = begin(self.db)
            .await
            .map_err(|e| store_error("beginning the claim transaction", e))?;
        let reject = matches!(req.concurrency, Concurrency::Reject);
        if reject && let Some(sql) = d.before_nowait {
            tx.execute_unprepared(sql)
                .await
                .map_err(|e| store_error("setting the lock timeout", e))?;
        }
        let insert = statement(
            d,
            if reject { &d.claim_nowait } else { &d.claim },
            vec![
                req.id.to_vec().into(),
                req.scope.into(),
                req.principal.into(),
                req.key.into(),
                req.owner.into(),
                req.fingerprint.0.to_vec().into(),
                ttl_ms(req).into(),
            ],
        );
        let inserted = if d.claim_returns {
            tx.query_one_raw(insert).await.map(|row| row.is_some())
        } else {
            tx.execute_raw(insert).await.map(|_| false)
        };
        let inserted = match inserted {
            Ok(inserted) => inserted,
            Err(e) if classify(&e) == Failure::LockTimeout => {
                let _ = tx.rollback().await;
                return Ok(Claim::InFlight);
            }
            Err(e) => return Err(store_error("claiming the key", e)),
        };
        if !inserted {
            let row = tx
                .query_one_raw(statement(d, &d.read_locked, vec![req.id.to_vec().into()]))
                .await
                .and_then(|row| {
                    row.map(|r| read_row(&r))
                        .transpose()
                        .map(|r| r.ok_or_else(|| DbErr::RecordNotFound("claimed row".into())))
                })
                .and_then(|r| r)
                .map_err(|e| store_error("reading the claimed key", e))?;
            if row.owner != req.owner {
                if row.expires_at_ms <= row.now_ms {
                    // An expired record is a new execution: take it over in this transaction.
                    tx.execute_raw(statement(
                        d,
                        &d.take_over,
                        vec![
                            req.owner.into(),
                            req.fingerprint.0.to_vec().into(),
                            ttl_ms(req).into(),
                            req.id.to_vec().into(),
                        ],
                    ))
                    .await
                    .map_err(|e| store_error("taking over an expired key", e))?;
                } else {
                    // Nothing was written: end the read-only transaction.
                    let _ = tx.rollback().await;
                    return Ok(match row.status {
                        Some(RecordStatus::Pending) => Claim::InFlight,
                        Some(status) => Claim::Recorded(Recorded {
                            fingerprint: row.fingerprint,
                            status,
                            payload: row.response.unwrap_or_default(),
                        }),
                        None => {
                            return Err(Error::Store {
                                message: "the ledger row has an unknown state".to_owned(),
                                source: None,
                            });
                        }
                    });
                }
            }
        }
        if req.savepoint {
            tx.execute_unprepared(SAVEPOINT)
                .await
                .map_err(|e| store_error("taking the claim savepoint", e))?;
        }
        Ok(Claim::Execute(tx))
    }

    async fn record(
        &self,
        tx: DatabaseTransaction,
        req: &ClaimRequest<'_>,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        let d = self.dialect();
        let updated = tx
            .execute_raw(statement(
                d,
                &d.record,
                vec![
                    status.code().into(),
                    payload.to_vec().into(),
                    ttl_ms(req).into(),
                    req.id.to_vec().into(),
                    req.owner.into(),
                ],
            ))
            .await
            .map_err(|e| store_error("recording the result", e))?;
        if updated.rows_affected() != 1 {
            return Err(Error::Store {
                message: "the claim was lost before its result was recorded".to_owned(),
                source: None,
            });
        }
        tx.commit()
            .await
            .map_err(|e| store_error("committing the result", e))
    }

    async fn rollback_to_claim(&self, tx: &DatabaseTransaction) -> Result<(), Error> {
        tx.execute_unprepared(ROLLBACK_TO_SAVEPOINT)
            .await
            .map(drop)
            .map_err(|e| store_error("rolling back the handler's writes", e))
    }

    async fn release(&self, tx: DatabaseTransaction) -> Result<(), Error> {
        tx.rollback()
            .await
            .map_err(|e| store_error("releasing the key", e))
    }
}
