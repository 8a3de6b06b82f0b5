//! The completer's store, once for every driver: idem-core's [`ResumeStore`] on
//! [`SqlStore`], each step one of this folder's algorithms on a pooled connection or in a
//! write transaction. Resumable calls live in the calls table, one row per call in progress,
//! written with its claim and deleted when the call is recorded (or, once given up, when its
//! hook ran).

use std::time::Duration;

use idem_core::completer::{Due, ResumeStore, Steps, StoredCall};
use idem_core::{BoxFuture, Error, detached};

use crate::driver::{db_error, failed};
use crate::store::SqlStore;
use crate::{Driver, Transaction};

impl<D: Driver> ResumeStore for SqlStore<D> {
    fn due_calls<'a>(
        &'a self,
        scopes: &'a [&'a str],
        limit: u32,
    ) -> BoxFuture<'a, Result<Due, Error>> {
        let store = self.clone();
        let scopes: Vec<String> = scopes.iter().map(|&scope| scope.to_owned()).collect();
        Box::pin(detached(async move {
            let scopes: Vec<&str> = scopes.iter().map(String::as_str).collect();
            let mut conn = store.pooled("finding resumable calls").await?;
            super::due_calls(&mut conn, store.statements(), &scopes, limit)
                .await
                .map_err(failed::<D>)
        }))
    }

    fn begin_attempt<'a>(
        &'a self,
        call: &'a StoredCall,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let mut conn = self.pooled("claiming an attempt").await?;
            super::begin_attempt(&mut conn, self.statements(), call, backoff)
                .await
                .map_err(failed::<D>)
        })
    }

    fn note_failure<'a>(
        &'a self,
        call: &'a StoredCall,
        error: &'a str,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            let mut conn = self.pooled("keeping an attempt's error").await?;
            super::note_failure(&mut conn, self.statements(), call, error)
                .await
                .map_err(failed::<D>)
        })
    }

    fn give_up<'a>(
        &'a self,
        call: &'a StoredCall,
        payload: &'a [u8],
        hook_retry: Duration,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let store = self.clone();
        let (call, payload) = (call.clone(), payload.to_vec());
        Box::pin(detached(async move {
            let doing = "giving a call up";
            let mut tx = store.begin_write(doing).await?;
            let gave_up = super::give_up(&mut tx, store.statements(), &call, payload, hook_retry)
                .await
                .map_err(failed::<D>)?;
            if !gave_up {
                // Finished or taken over meanwhile.
                let _ = tx.rollback().await;
                return Ok(false);
            }
            tx.commit().await.map_err(|e| db_error::<D>(doing, e))?;
            Ok(true)
        }))
    }

    fn steps<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<Steps, Error>> {
        Box::pin(async move {
            let mut conn = self.pooled("reading a call's steps").await?;
            super::steps(&mut conn, self.statements(), call)
                .await
                .map_err(failed::<D>)
        })
    }

    fn forget<'a>(&'a self, call: &'a StoredCall) -> BoxFuture<'a, Result<(), Error>> {
        let store = self.clone();
        let call = call.clone();
        Box::pin(detached(async move {
            let doing = "forgetting a given-up call";
            let mut tx = store.begin_write(doing).await?;
            super::forget(&mut tx, store.statements(), &call)
                .await
                .map_err(failed::<D>)?;
            tx.commit().await.map_err(|e| db_error::<D>(doing, e))
        }))
    }

    fn unregistered<'a>(
        &'a self,
        scopes: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, u64)>, Error>> {
        Box::pin(async move {
            let mut conn = self.pooled("counting calls nobody resumes").await?;
            super::unregistered(&mut conn, self.statements(), scopes)
                .await
                .map_err(failed::<D>)
        })
    }
}
