//! Nested calls on sqlx: an `#[idempotent]` function whose connection is a [`Conn`] runs at
//! the top on a pool, or inside another call's body on that body's `&mut PgConnection`, where
//! it claims its key in a savepoint of the outer call's transaction and commits with it or
//! not at all.

use std::sync::Mutex;

use idem_core::ledger::ids::random_token;
use idem_core::{Claim, Concurrency, Error, RecordStatus, Request, Store};
use idem_sql::{
    ClaimRow, ClaimStep, Claimed, Dialect, Failure, NewRecord, Savepoint, Sql, learn_flavour,
};
use sqlx::Pool;

use crate::atomic::{ClaimedTx, SqlxStore};
use crate::driver::Backend;
use crate::driver::error::{classify, failed, store_error};
use crate::driver::port::{SqlxConn, on};

/// The connection of an `#[idempotent]` function that is called at the top of a request (on
/// a pool) and inside another call's body (on that body's transaction). Build it with `.into()`
/// from either:
///
/// ```text
/// #[idempotent(scope = "shop.charge", key = cmd.key)]
/// async fn charge(db: idem::sqlx::Conn<'_, Postgres>, cmd: Charge) -> Result<Receipt, ShopError> {
///     sqlx::query("INSERT INTO charges ...").execute(&mut *db).await?;   // db: &mut PgConnection
///     ...
/// }
/// charge((&pool).into(), cmd).await                  // at the top: a transaction of its own
/// charge((&mut *db).into(), cmd).await               // in another call's body: a savepoint in it
/// ```
///
/// Nested, the call claims its key in a savepoint of the outer transaction: its record and its
/// writes commit when the outer call commits, and vanish if it rolls back (the outer call's
/// retry then runs the inner one again, with the same key). A final error of the inner call is
/// recorded and the outer body goes on. Its record is invisible to other transactions until
/// the outer commit, so a duplicate elsewhere waits for the outer call's lock on the key.
pub enum Conn<'c, DB: Backend> {
    /// At the top: the claim begins a transaction on the pool.
    Pool(&'c Pool<DB>),
    /// Inside another call's body: the claim is a savepoint of that body's transaction.
    Nested(Nested<'c, DB>),
}

impl<'c, DB: Backend> From<&'c Pool<DB>> for Conn<'c, DB> {
    fn from(pool: &'c Pool<DB>) -> Self {
        Self::Pool(pool)
    }
}

impl<'c, DB: Backend> From<&'c mut DB::Connection> for Conn<'c, DB> {
    fn from(conn: &'c mut DB::Connection) -> Self {
        Self::Nested(Nested {
            conn: Mutex::new(Some(conn)),
        })
    }
}

impl<DB: Backend> std::fmt::Debug for Conn<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Self::Pool(_) => "Pool",
            Self::Nested(_) => "Nested",
        };
        f.debug_tuple(kind).field(&DB::NAME).finish()
    }
}

/// Another call's transaction, lent to a nested call: the claim takes the connection out for
/// as long as it holds the key and puts it back when it records or releases (a call whose
/// claim the database aborted for a conflict claims again).
pub struct Nested<'c, DB: Backend> {
    conn: Mutex<Option<&'c mut DB::Connection>>,
}

impl<DB: Backend> std::fmt::Debug for Nested<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nested")
            .field("database", &DB::NAME)
            .finish_non_exhaustive()
    }
}

impl<'c, DB: Backend> Nested<'c, DB> {
    fn take(&self) -> Result<&'c mut DB::Connection, Error> {
        let taken = self.conn.lock().unwrap_or_else(|e| e.into_inner()).take();
        taken.ok_or_else(|| Error::Store {
            message: "a nested call's connection is already in use by its claim".to_owned(),
            source: None,
        })
    }

    fn give_back(&self, conn: &'c mut DB::Connection) {
        *self.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
    }
}

/// The store behind a [`Conn`]: the pool's, or savepoints in another call's transaction.
pub enum ConnStore<'a, 'c, DB: Backend> {
    /// On the pool.
    Pool(SqlxStore<'c, DB>),
    /// In another call's transaction.
    Nested(&'a Nested<'c, DB>),
}

impl<DB: Backend> std::fmt::Debug for ConnStore<'_, '_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Pool(store) => f.debug_tuple("Pool").field(store).finish(),
            Self::Nested(nested) => f.debug_tuple("Nested").field(nested).finish(),
        }
    }
}

/// A key claimed through a [`Conn`].
pub enum ConnClaimed<'c, DB: Backend> {
    /// In a transaction of its own on the pool.
    Pool(ClaimedTx<DB>),
    /// In a savepoint of another call's transaction.
    Nested(NestedClaim<'c, DB>),
}

impl<DB: Backend> std::fmt::Debug for ConnClaimed<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Pool(claimed) => f.debug_tuple("Pool").field(claimed).finish(),
            Self::Nested(claimed) => f.debug_tuple("Nested").field(claimed).finish(),
        }
    }
}

/// A key claimed in a savepoint of another call's transaction.
pub struct NestedClaim<'c, DB: Backend> {
    conn: &'c mut DB::Connection,
    owner: i64,
    sql: &'static Sql,
    /// The savepoint the claim began with: released to keep the call, rolled back to drop it.
    savepoint: Savepoint,
    /// The savepoint after the claim, where a final error rolls the body's writes back to.
    body: Option<Savepoint>,
}

impl<DB: Backend> std::fmt::Debug for NestedClaim<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NestedClaim")
            .field("savepoint", &self.savepoint)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

async fn run<DB: Backend>(conn: &mut DB::Connection, sql: String) -> Result<(), sqlx::Error> {
    DB::execute_unprepared(conn, &sql).await
}

/// The statements of the server behind `conn`: on the MySQL protocol its family, asked on
/// the connection (a connection does not say which server it came from).
async fn statements_of<DB: Backend>(conn: &mut DB::Connection) -> &'static Sql {
    Sql::of(learn_flavour(&mut SqlxConn::<DB>::new(conn, true), DB::DIALECT, None).await)
}

/// Ends a nested claim's savepoint: kept (`RELEASE`), or undone first (`ROLLBACK TO`).
async fn end_savepoint<DB: Backend>(
    conn: &mut DB::Connection,
    savepoint: &Savepoint,
    undo: bool,
) -> Result<(), sqlx::Error> {
    if undo {
        run::<DB>(conn, savepoint.rollback_to()).await?;
    }
    run::<DB>(conn, savepoint.release()).await
}

impl<'c, DB: Backend> ConnStore<'_, 'c, DB> {
    async fn claim_nested(
        nested: &Nested<'c, DB>,
        req: &Request,
    ) -> Result<Claim<ConnClaimed<'c, DB>>, Error> {
        let conn = nested.take()?;
        let sql = statements_of::<DB>(conn).await;
        let savepoint = Savepoint::nested("claim");
        if let Err(e) = run::<DB>(conn, savepoint.take()).await {
            nested.give_back(conn);
            return Err(store_error("beginning the nested claim's savepoint", e));
        }
        let step = ClaimStep {
            row: NewRecord::of(req, random_token(), req.ttl()),
            reject: req.concurrency() == Concurrency::Reject,
            // The body's own savepoint is taken below, under a name of its own.
            savepoint: false,
        };
        let claimed = idem_sql::claim(&mut on::<DB>(conn, true), sql, &step).await;
        let row = match claimed {
            Ok(Claimed::Execute) => {
                let body = req.savepoint().then(|| Savepoint::nested("body"));
                if let Some(body) = &body
                    && let Err(e) = run::<DB>(conn, body.take()).await
                {
                    let _ = end_savepoint::<DB>(conn, &savepoint, true).await;
                    nested.give_back(conn);
                    return Err(store_error("taking the claim savepoint", e));
                }
                return Ok(Claim::Execute(ConnClaimed::Nested(NestedClaim {
                    conn,
                    owner: step.row.owner,
                    sql,
                    savepoint,
                    body,
                })));
            }
            Ok(Claimed::InFlight) => None,
            Ok(Claimed::Live(row) | Claimed::LiveLocked(row)) => Some(row),
            Err(fault) => {
                let _ = end_savepoint::<DB>(conn, &savepoint, true).await;
                nested.give_back(conn);
                return Err(failed(fault));
            }
        };
        // Nothing of the claim is kept: the outer transaction goes on as before it.
        let ended = end_savepoint::<DB>(conn, &savepoint, true).await;
        nested.give_back(conn);
        ended.map_err(|e| store_error("ending the nested claim's savepoint", e))?;
        match row {
            None => Ok(Claim::InFlight),
            Some(row) => row.answer().ok_or_else(|| Error::Store {
                message:
                    "the ledger row has an unknown state (written by a newer version of idem?)"
                        .to_owned(),
                source: None,
            }),
        }
    }
}

impl<'c, DB: Backend> Store for ConnStore<'_, 'c, DB> {
    type Tx<'t> = &'t mut DB::Connection;
    type Claimed = ConnClaimed<'c, DB>;

    fn tx<'t>(claimed: &'t mut ConnClaimed<'c, DB>) -> &'t mut DB::Connection {
        match claimed {
            ConnClaimed::Pool(claimed) => SqlxStore::<DB>::tx(claimed),
            ConnClaimed::Nested(claimed) => &mut *claimed.conn,
        }
    }

    async fn claim(&self, req: &Request) -> Result<Claim<ConnClaimed<'c, DB>>, Error> {
        match self {
            Self::Pool(store) => Ok(store.claim(req).await?.map_execute(ConnClaimed::Pool)),
            Self::Nested(nested) => Self::claim_nested(nested, req).await,
        }
    }

    async fn record(
        &self,
        claimed: ConnClaimed<'c, DB>,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        let claimed = match (self, claimed) {
            (Self::Pool(store), ConnClaimed::Pool(claimed)) => {
                return store.record(claimed, req, status, payload).await;
            }
            (Self::Nested(nested), ConnClaimed::Nested(claimed)) => (nested, claimed),
            _ => return Err(mismatched()),
        };
        let (nested, claim) = claimed;
        let conn = claim.conn;
        let recorded = async {
            // A final error keeps only the recorded error: back to the body's savepoint first.
            if status == RecordStatus::Failed
                && let Some(body) = &claim.body
            {
                run::<DB>(conn, body.rollback_to())
                    .await
                    .map_err(|e| store_error("rolling back the handler's writes", e))?;
            }
            let row = NewRecord::of(req, claim.owner, req.ttl());
            let record = claim.sql.ledger.record(&row, status.code(), payload);
            let updated = DB::execute(conn, record, true)
                .await
                .map_err(|e| store_error("recording the result", e))?;
            if updated != 1 {
                return Err(idem_sql::claim_lost());
            }
            end_savepoint::<DB>(conn, &claim.savepoint, false)
                .await
                .map_err(|e| store_error("keeping the nested call", e))
        }
        .await;
        if recorded.is_err() {
            let _ = end_savepoint::<DB>(conn, &claim.savepoint, true).await;
        }
        nested.give_back(conn);
        recorded
    }

    async fn release(&self, claimed: ConnClaimed<'c, DB>) -> Result<(), Error> {
        match (self, claimed) {
            (Self::Pool(store), ConnClaimed::Pool(claimed)) => store.release(claimed).await,
            (Self::Nested(nested), ConnClaimed::Nested(claim)) => {
                let ended = end_savepoint::<DB>(claim.conn, &claim.savepoint, true).await;
                nested.give_back(claim.conn);
                ended.map_err(|e| store_error("releasing the key", e))
            }
            _ => Err(mismatched()),
        }
    }

    async fn aborted(&self, claimed: &mut ConnClaimed<'c, DB>, req: &Request) -> bool {
        match (self, claimed) {
            (Self::Pool(store), ConnClaimed::Pool(claimed)) => store.aborted(claimed, req).await,
            // As on the pool (see `SqlxStore::aborted`): on MySQL a conflict rolled the whole
            // outer transaction back, with the claim's row.
            (Self::Nested(_), ConnClaimed::Nested(claim)) => {
                if claim.sql.dialect != Dialect::MySql {
                    return false;
                }
                let read = claim.sql.ledger.read_locked(req.id());
                match DB::fetch_first(claim.conn, read, true, ClaimRow::from_row).await {
                    Ok(Some(row)) => row.owner != claim.owner,
                    Ok(None) => true,
                    Err(e) => classify(&e) == Failure::Transient,
                }
            }
            _ => false,
        }
    }

    async fn begin(&self) -> Result<ConnClaimed<'c, DB>, Error> {
        match self {
            Self::Pool(store) => store.begin().await.map(ConnClaimed::Pool),
            Self::Nested(nested) => {
                let conn = nested.take()?;
                let savepoint = Savepoint::nested("off");
                if let Err(e) = run::<DB>(conn, savepoint.take()).await {
                    nested.give_back(conn);
                    return Err(store_error("beginning the handler's savepoint", e));
                }
                let sql = statements_of::<DB>(conn).await;
                Ok(ConnClaimed::Nested(NestedClaim {
                    conn,
                    owner: 0,
                    sql,
                    savepoint,
                    body: None,
                }))
            }
        }
    }

    async fn commit(&self, claimed: ConnClaimed<'c, DB>) -> Result<(), Error> {
        match (self, claimed) {
            (Self::Pool(store), ConnClaimed::Pool(claimed)) => store.commit(claimed).await,
            (Self::Nested(nested), ConnClaimed::Nested(claim)) => {
                let ended = end_savepoint::<DB>(claim.conn, &claim.savepoint, false).await;
                nested.give_back(claim.conn);
                ended.map_err(|e| store_error("committing the handler's writes", e))
            }
            _ => Err(mismatched()),
        }
    }

    fn ledger_identity(&self) -> Option<usize> {
        match self {
            Self::Pool(store) => store.ledger_identity(),
            // A nested claim's record is seen by others only when the outer call commits: its
            // duplicates in this process cannot wait for it in memory.
            Self::Nested(_) => None,
        }
    }
}

/// A claim handed back to a store of the other kind: the engine never does this.
fn mismatched() -> Error {
    Error::Store {
        message: "a claim was handed to a store of another kind".to_owned(),
        source: None,
    }
}
