//! The completer's store on a sqlx pool: resumable calls live in the calls table
//! ([`Family::Completer`](crate::Family::Completer)), one row per call in progress, written
//! with its claim and deleted when the call is recorded (or, once given up, when its hook
//! ran). What the completer's statements are and what their rows decide is idem-sql's
//! ([`idem_sql::due_calls`] and its neighbours), and so is the store that runs them, written
//! once for every driver ([`idem_sql::SqlStore`]); the lease store lends it.

use std::time::Duration;

use idem_core::completer::{Due, ResumeStore, Steps, StoredCall};
use idem_core::{BoxFuture, Error};

use crate::driver::Backend;
use crate::lease::SqlxLeaseStore;

/// A [`Completer`](idem_core::Completer) on a sqlx pool: finishes resumable lease-mode calls
/// whose clients did not come back. `Completer::new(SqlxLeaseStore::new(pool.clone()))`;
/// the calls table must exist ([`create_tables`](crate::create_tables) with
/// [`Family::Completer`](crate::Family::Completer), or `idem schema`).
pub type Completer<DB> = idem_core::Completer<SqlxLeaseStore<DB>>;

impl<DB: Backend> ResumeStore for SqlxLeaseStore<DB> {
    fn due_calls<'a>(
        &'a self,
        scopes: &'a [&'a str],
        limit: u32,
    ) -> BoxFuture<'a, Result<Due, Error>> {
        self.generic().due_calls(scopes, limit)
    }

    fn begin_attempt<'a>(
        &'a self,
        call: &'a StoredCall,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.generic().begin_attempt(call, backoff)
    }

    fn note_failure<'a>(
        &'a self,
        call: &'a StoredCall,
        error: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.generic().note_failure(call, error)
    }

    fn give_up<'a>(
        &'a self,
        call: &'a StoredCall,
        payload: &'a [u8],
        hook_retry: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.generic().give_up(call, payload, hook_retry)
    }

    fn steps<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<Steps, Error>> {
        self.generic().steps(call)
    }

    fn forget<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<(), Error>> {
        self.generic().forget(call)
    }

    fn unregistered<'a>(
        &'a self,
        scopes: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, u64)>, Error>> {
        self.generic().unregistered(scopes)
    }
}
