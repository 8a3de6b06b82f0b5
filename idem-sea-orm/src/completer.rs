//! The completer's store on the SeaORM ledger: resumable calls live in the calls table
//! ([`CALLS_TABLE`](crate::CALLS_TABLE)), one row per call in progress, written with its claim
//! and deleted when the call is recorded (or, once given up, when its hook ran).

use std::time::Duration;

use idem_core::completer::{Due, ResumeStore, Steps, StoredCall};
use idem_core::{BoxFuture, Error};
use sea_orm::{ConnectionTrait, DbErr, QueryResult};

use crate::atomic::{begin, detached};
use crate::driver::error::store_error;
use crate::driver::{Bound, millis, statement};
use crate::lease::SeaOrmLeaseStore;

/// A [`Completer`](idem_core::Completer) on the SeaORM ledger: finishes resumable lease-mode
/// calls whose clients did not come back. `Completer::new(SeaOrmLeaseStore::new(db))`.
pub type Completer = idem_core::Completer<SeaOrmLeaseStore>;

fn stored_call(row: &QueryResult) -> Result<StoredCall, DbErr> {
    let (id, scope, principal, key, args) =
        row.try_get_many_by_index::<(Vec<u8>, String, String, String, Vec<u8>)>()?;
    let attempts: i32 = row.try_get_by_index(5)?;
    let last_error: Option<String> = row.try_get_by_index(6)?;
    let gave_up: i16 = row.try_get_by_index(7)?;
    let final_phase_done: i16 = row.try_get_by_index(8)?;
    Ok(StoredCall::new(
        id,
        scope,
        principal,
        key,
        args,
        u32::try_from(attempts).unwrap_or(0),
        last_error,
        gave_up == 1,
    )
    .with_final_phase_done(final_phase_done == 1))
}

/// The attempts count a conditional update compares with: the one read.
fn attempts(call: &StoredCall) -> i32 {
    i32::try_from(call.attempts).unwrap_or(i32::MAX)
}

impl SeaOrmLeaseStore {
    /// Runs `update` and tells whether it changed exactly one row.
    async fn changed_one(&self, update: Bound<'_>, doing: &str) -> Result<bool, Error> {
        let d = crate::driver::of(self.db().get_database_backend());
        self.db()
            .execute_raw(statement(d, update))
            .await
            .map(|done| done.rows_affected() == 1)
            .map_err(|e| store_error(doing, e))
    }
}

impl ResumeStore for SeaOrmLeaseStore {
    fn due_calls<'a>(
        &'a self,
        scopes: &'a [&'a str],
        limit: u32,
    ) -> BoxFuture<'a, Result<Due, Error>> {
        let d = crate::driver::of(self.db().get_database_backend());
        let due = d.completer.due_calls(scopes, limit);
        let next = d.completer.next_due_in(scopes);
        let db = self.db().clone();
        Box::pin(detached(async move {
            let doing = "finding resumable calls";
            let rows = db
                .query_all_raw(statement(d, due))
                .await
                .map_err(|e| store_error(doing, e))?;
            let calls = rows
                .iter()
                .map(stored_call)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| store_error(doing, e))?;
            let next_in = db
                .query_one_raw(statement(d, next))
                .await
                .and_then(|row| {
                    row.map(|r| r.try_get_by_index::<Option<i64>>(0))
                        .transpose()
                })
                .map_err(|e| store_error(doing, e))?
                .flatten()
                .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
            Ok(Due::new(calls, next_in))
        }))
    }

    fn begin_attempt<'a>(
        &'a self,
        call: &'a StoredCall,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let d = crate::driver::of(self.db().get_database_backend());
        let begin = d
            .completer
            .begin_attempt(&call.id, attempts(call), millis(backoff));
        Box::pin(async move { self.changed_one(begin, "claiming an attempt").await })
    }

    fn note_failure<'a>(
        &'a self,
        call: &'a StoredCall,
        error: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let d = crate::driver::of(self.db().get_database_backend());
        // Bounded: an error text can be long (a response body); the start says what failed.
        let error: String = error.chars().take(2000).collect();
        let note = d.completer.note_call_error(&call.id, error);
        Box::pin(async move {
            self.changed_one(note, "keeping an attempt's error")
                .await
                .map(drop)
        })
    }

    fn give_up<'a>(
        &'a self,
        call: &'a StoredCall,
        payload: &'a [u8],
        hook_retry: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let db = self.db().clone();
        let (id, payload) = (call.id.clone(), payload.to_vec());
        Box::pin(detached(async move {
            let doing = "giving a call up";
            let d = crate::driver::of(db.get_database_backend());
            let tx = begin(&db).await.map_err(|e| store_error(doing, e))?;
            let gave_up = tx
                .execute_raw(statement(d, d.completer.give_up(&id, payload)))
                .await
                .map_err(|e| store_error(doing, e))?
                .rows_affected()
                == 1;
            if !gave_up {
                // Finished or taken over meanwhile.
                let _ = tx.rollback().await;
                return Ok(false);
            }
            tx.execute_raw(statement(d, d.completer.owe_hook(&id, millis(hook_retry))))
                .await
                .map_err(|e| store_error(doing, e))?;
            tx.commit().await.map_err(|e| store_error(doing, e))?;
            Ok(true)
        }))
    }

    fn steps<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<Steps, Error>> {
        let d = crate::driver::of(self.db().get_database_backend());
        let select = d.lease.select_steps(&call.id);
        Box::pin(async move {
            let rows = self
                .db()
                .query_all_raw(statement(d, select))
                .await
                .map_err(|e| store_error("reading a call's steps", e))?;
            rows.iter()
                .map(|r| Ok((r.try_get_by_index(0)?, r.try_get_by_index(1)?)))
                .collect::<Result<_, DbErr>>()
                .map_err(|e| store_error("reading a call's steps", e))
        })
    }

    fn forget<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<(), Error>> {
        let db = self.db().clone();
        let id = call.id.clone();
        Box::pin(detached(async move {
            let doing = "forgetting a given-up call";
            let d = crate::driver::of(db.get_database_backend());
            let tx = begin(&db).await.map_err(|e| store_error(doing, e))?;
            for forget in [d.completer.forget_given_up(&id), d.lease.delete_steps(&id)] {
                tx.execute_raw(statement(d, forget))
                    .await
                    .map_err(|e| store_error(doing, e))?;
            }
            tx.commit().await.map_err(|e| store_error(doing, e))
        }))
    }

    fn unregistered<'a>(
        &'a self,
        scopes: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, u64)>, Error>> {
        let d = crate::driver::of(self.db().get_database_backend());
        let unregistered = d.completer.unregistered_calls(scopes);
        Box::pin(async move {
            let doing = "counting calls nobody resumes";
            let rows = self
                .db()
                .query_all_raw(statement(d, unregistered))
                .await
                .map_err(|e| store_error(doing, e))?;
            rows.iter()
                .map(|r| {
                    let (scope, count) = r.try_get_many_by_index::<(String, i64)>()?;
                    Ok((scope, u64::try_from(count).unwrap_or(0)))
                })
                .collect::<Result<_, DbErr>>()
                .map_err(|e| store_error(doing, e))
        })
    }
}
