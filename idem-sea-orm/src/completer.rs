//! The completer's store on the SeaORM ledger: resumable calls live in the calls table
//! ([`CALLS_TABLE`](crate::CALLS_TABLE)), one row per call in progress, written with its claim
//! and deleted when the call is recorded (or, once given up, when its hook ran). What the
//! completer's statements are and what their rows decide is idem-sql's
//! ([`idem_sql::due_calls`] and its neighbours), the same the sqlx store runs; this file
//! begins, commits and decodes.

use std::time::Duration;

use idem_core::completer::{Due, ResumeStore, Steps, StoredCall};
use idem_core::{BoxFuture, Error};
use idem_sql::{CallColumns, ResumeConnection};
use sea_orm::{ConnectionTrait, DbErr};

use crate::atomic::{begin, detached};
use crate::driver::error::store_error;
use crate::driver::{Bound, Sql, fetch_each, fetch_first, statement};
use crate::lease::SeaOrmLeaseStore;

/// A [`Completer`](idem_core::Completer) on the SeaORM ledger: finishes resumable lease-mode
/// calls whose clients did not come back. `Completer::new(SeaOrmLeaseStore::new(db))`.
pub type Completer = idem_core::Completer<SeaOrmLeaseStore>;

/// A connection (the pool, or a transaction begun for a give-up or a forget) as idem-sql's
/// completer runs its statements on it, and the statements' dialect.
struct OnConnection<'c, C> {
    db: &'c C,
    sql: &'static Sql,
}

impl<C: ConnectionTrait + Sync> ResumeConnection for OnConnection<'_, C> {
    type Error = DbErr;

    async fn execute(&mut self, bound: Bound<'static>) -> Result<u64, DbErr> {
        let done = self.db.execute_raw(statement(self.sql, bound)).await?;
        Ok(done.rows_affected())
    }

    async fn fetch_calls(&mut self, bound: Bound<'static>) -> Result<Vec<CallColumns>, DbErr> {
        fetch_each(self.db, self.sql, bound, idem_sql::read_call_columns).await
    }

    async fn fetch_millis(&mut self, bound: Bound<'static>) -> Result<Option<i64>, DbErr> {
        let millis = fetch_first(self.db, self.sql, bound, idem_sql::Row::into_opt_i64).await?;
        Ok(millis.flatten())
    }

    async fn fetch_counts(&mut self, bound: Bound<'static>) -> Result<Vec<(String, i64)>, DbErr> {
        fetch_each(self.db, self.sql, bound, idem_sql::read_count).await
    }

    async fn fetch_steps(
        &mut self,
        bound: Bound<'static>,
    ) -> Result<Vec<(String, Vec<u8>)>, DbErr> {
        fetch_each(self.db, self.sql, bound, idem_sql::read_step).await
    }
}

/// An idem-sql step's error, with what it was doing.
fn failed((doing, e): (&'static str, DbErr)) -> Error {
    store_error(doing, e)
}

impl SeaOrmLeaseStore {
    /// The store's pool as idem-sql's completer runs statements on it.
    fn on_pool(&self) -> OnConnection<'_, sea_orm::DatabaseConnection> {
        OnConnection {
            db: self.db(),
            sql: crate::driver::of(self.db().get_database_backend()),
        }
    }
}

impl ResumeStore for SeaOrmLeaseStore {
    fn due_calls<'a>(
        &'a self,
        scopes: &'a [&'a str],
        limit: u32,
    ) -> BoxFuture<'a, Result<Due, Error>> {
        let db = self.db().clone();
        let scopes: Vec<String> = scopes.iter().map(|&scope| scope.to_owned()).collect();
        Box::pin(detached(async move {
            let scopes: Vec<&str> = scopes.iter().map(String::as_str).collect();
            let sql = crate::driver::of(db.get_database_backend());
            let mut conn = OnConnection { db: &db, sql };
            idem_sql::due_calls(&mut conn, sql, &scopes, limit)
                .await
                .map_err(failed)
        }))
    }

    fn begin_attempt<'a>(
        &'a self,
        call: &'a StoredCall,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let mut conn = self.on_pool();
            let sql = conn.sql;
            idem_sql::begin_attempt(&mut conn, sql, call, backoff)
                .await
                .map_err(failed)
        })
    }

    fn note_failure<'a>(
        &'a self,
        call: &'a StoredCall,
        error: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let mut conn = self.on_pool();
            let sql = conn.sql;
            idem_sql::note_failure(&mut conn, sql, call, error)
                .await
                .map_err(failed)
        })
    }

    fn give_up<'a>(
        &'a self,
        call: &'a StoredCall,
        payload: &'a [u8],
        hook_retry: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let db = self.db().clone();
        let (call, payload) = (call.clone(), payload.to_vec());
        Box::pin(detached(async move {
            let doing = "giving a call up";
            let sql = crate::driver::of(db.get_database_backend());
            let tx = begin(&db).await.map_err(|e| store_error(doing, e))?;
            let mut conn = OnConnection { db: &tx, sql };
            let gave_up = idem_sql::give_up(&mut conn, sql, &call, payload, hook_retry)
                .await
                .map_err(failed)?;
            if !gave_up {
                // Finished or taken over meanwhile.
                let _ = tx.rollback().await;
                return Ok(false);
            }
            tx.commit().await.map_err(|e| store_error(doing, e))?;
            Ok(true)
        }))
    }

    fn steps<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<Steps, Error>> {
        Box::pin(async move {
            let mut conn = self.on_pool();
            let sql = conn.sql;
            idem_sql::steps(&mut conn, sql, call).await.map_err(failed)
        })
    }

    fn forget<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<(), Error>> {
        let db = self.db().clone();
        let call = call.clone();
        Box::pin(detached(async move {
            let doing = "forgetting a given-up call";
            let sql = crate::driver::of(db.get_database_backend());
            let tx = begin(&db).await.map_err(|e| store_error(doing, e))?;
            idem_sql::forget(&mut OnConnection { db: &tx, sql }, sql, &call)
                .await
                .map_err(failed)?;
            tx.commit().await.map_err(|e| store_error(doing, e))
        }))
    }

    fn unregistered<'a>(
        &'a self,
        scopes: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, u64)>, Error>> {
        Box::pin(async move {
            let mut conn = self.on_pool();
            let sql = conn.sql;
            idem_sql::unregistered(&mut conn, sql, scopes)
                .await
                .map_err(failed)
        })
    }
}
