//! The completer's store on a sqlx pool: resumable calls live in the calls table
//! ([`Family::Completer`](crate::Family::Completer)), one row per call in progress, written
//! with its claim and deleted when the call is recorded (or, once given up, when its hook
//! ran). What the completer's statements are and what their rows decide is idem-sql's
//! ([`idem_sql::due_calls`] and its neighbours), the same the SeaORM store runs; this file
//! acquires, begins, commits and decodes.

use std::time::Duration;

use idem_core::completer::{Due, ResumeStore, Steps, StoredCall};
use idem_core::{BoxFuture, Error, detached};
use idem_sql::{Bound, CallColumns, ResumeConnection, Row};

use crate::atomic::InClaim;
use crate::driver::Backend;
use crate::driver::error::store_error;
use crate::lease::{SqlxLeaseStore, acquire, failed, statements};

/// A [`Completer`](idem_core::Completer) on a sqlx pool: finishes resumable lease-mode calls
/// whose clients did not come back. `Completer::new(SqlxLeaseStore::new(pool.clone()))`;
/// the calls table must exist ([`create_tables`](crate::create_tables) with
/// [`Family::Completer`](crate::Family::Completer), or `idem schema`).
pub type Completer<DB> = idem_core::Completer<SqlxLeaseStore<DB>>;

impl<DB: Backend> ResumeConnection for InClaim<'_, DB> {
    type Error = sqlx::Error;

    async fn execute(&mut self, statement: Bound<'static>) -> Result<u64, sqlx::Error> {
        DB::execute(self.conn, statement, self.named).await
    }

    async fn fetch_calls(
        &mut self,
        statement: Bound<'static>,
    ) -> Result<Vec<CallColumns>, sqlx::Error> {
        DB::fetch_each(
            self.conn,
            statement,
            self.named,
            idem_sql::read_call_columns,
        )
        .await
    }

    async fn fetch_millis(
        &mut self,
        statement: Bound<'static>,
    ) -> Result<Option<i64>, sqlx::Error> {
        DB::fetch_first(self.conn, statement, self.named, Row::into_opt_i64)
            .await
            .map(Option::flatten)
    }

    async fn fetch_counts(
        &mut self,
        statement: Bound<'static>,
    ) -> Result<Vec<(String, i64)>, sqlx::Error> {
        DB::fetch_each(self.conn, statement, self.named, idem_sql::read_count).await
    }

    async fn fetch_steps(
        &mut self,
        statement: Bound<'static>,
    ) -> Result<Vec<(String, Vec<u8>)>, sqlx::Error> {
        DB::fetch_each(self.conn, statement, self.named, idem_sql::read_step).await
    }
}

impl<DB: Backend> ResumeStore for SqlxLeaseStore<DB> {
    fn due_calls<'a>(
        &'a self,
        scopes: &'a [&'a str],
        limit: u32,
    ) -> BoxFuture<'a, Result<Due, Error>> {
        let pool = self.pool().clone();
        let scopes: Vec<String> = scopes.iter().map(|&scope| scope.to_owned()).collect();
        Box::pin(detached(async move {
            let scopes: Vec<&str> = scopes.iter().map(String::as_str).collect();
            let (mut conn, sql, named) = acquire(&pool, "finding resumable calls").await?;
            let conn = &mut InClaim::<DB> {
                conn: &mut conn,
                named,
            };
            idem_sql::due_calls(conn, sql, &scopes, limit)
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
            let (mut conn, sql, named) = acquire(self.pool(), "claiming an attempt").await?;
            let conn = &mut InClaim::<DB> {
                conn: &mut conn,
                named,
            };
            idem_sql::begin_attempt(conn, sql, call, backoff)
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
            let (mut conn, sql, named) = acquire(self.pool(), "keeping an attempt's error").await?;
            let conn = &mut InClaim::<DB> {
                conn: &mut conn,
                named,
            };
            idem_sql::note_failure(conn, sql, call, error)
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
        let pool = self.pool().clone();
        let (call, payload) = (call.clone(), payload.to_vec());
        Box::pin(detached(async move {
            let doing = "giving a call up";
            let (sql, named) = statements(&pool).await;
            let mut tx = DB::begin_claim(&pool)
                .await
                .map_err(|e| store_error(doing, e))?;
            let mut conn = InClaim::<DB> {
                conn: &mut tx,
                named,
            };
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
            let (mut conn, sql, named) = acquire(self.pool(), "reading a call's steps").await?;
            let conn = &mut InClaim::<DB> {
                conn: &mut conn,
                named,
            };
            idem_sql::steps(conn, sql, call).await.map_err(failed)
        })
    }

    fn forget<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<(), Error>> {
        let pool = self.pool().clone();
        let call = call.clone();
        Box::pin(detached(async move {
            let doing = "forgetting a given-up call";
            let (sql, named) = statements(&pool).await;
            let mut tx = DB::begin_claim(&pool)
                .await
                .map_err(|e| store_error(doing, e))?;
            let mut conn = InClaim::<DB> {
                conn: &mut tx,
                named,
            };
            idem_sql::forget(&mut conn, sql, &call)
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
            let (mut conn, sql, named) =
                acquire(self.pool(), "counting calls nobody resumes").await?;
            let conn = &mut InClaim::<DB> {
                conn: &mut conn,
                named,
            };
            idem_sql::unregistered(conn, sql, scopes)
                .await
                .map_err(failed)
        })
    }
}
