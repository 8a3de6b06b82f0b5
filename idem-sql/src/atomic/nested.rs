//! Nested calls, once for every driver: an `#[idempotent]` function called with another
//! call's body claims its key in a savepoint of that body's transaction, and commits with it
//! or not at all. [`ConnStore`] is the store of a connection that may be either: a pool at
//! the top of a request, or a body inside another call.

use std::sync::Mutex;

use idem_core::{Claim, Error, RecordStatus, Request, Store};

use super::store::{ClaimStep, Claimed, ClaimedTx, claim, claim_aborted, claim_step, live_answer};
use crate::driver::{db_error, failed};
use crate::{Dialect, Driver, NewRecord, Sql, SqlStore, learn_flavour};

/// Another call's body, lent to a nested call: its claim takes the body for as long as it
/// holds the key and gives it back when it records or releases (a call whose claim the
/// database aborted for a conflict claims again).
///
/// Nested, a call claims its key in a savepoint of the outer transaction: its record and its
/// writes commit when the outer call commits, and vanish if it rolls back (the outer call's
/// retry then runs the inner one again, with the same key). A final error of the inner call is
/// recorded and the outer body goes on. Its record is invisible to other transactions until
/// the outer commit, so a duplicate elsewhere waits for the outer call's lock on the key, and
/// duplicates in this process do not wait for it in memory (no single flight). A nested call
/// dropped before it ends (a `select!`, a timeout) leaves nothing: its savepoint is rolled
/// back to before the outer body's next statement.
pub struct Nested<'c, D: Driver> {
    body: Mutex<Option<D::Body<'c>>>,
    dialect: Dialect,
}

impl<D: Driver> std::fmt::Debug for Nested<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nested")
            .field("dialect", &self.dialect)
            .finish_non_exhaustive()
    }
}

impl<'c, D: Driver> Nested<'c, D> {
    /// Another call's `body`, lent to the calls nested in it.
    pub fn new(body: D::Body<'c>) -> Self {
        Nested {
            dialect: D::body_dialect(&body),
            body: Mutex::new(Some(body)),
        }
    }

    fn take(&self) -> Result<D::Body<'c>, Error> {
        let taken = self.body.lock().unwrap_or_else(|e| e.into_inner()).take();
        taken.ok_or_else(|| Error::Store {
            message: "a nested call's connection is already in use by its claim".to_owned(),
            source: None,
        })
    }

    fn give_back(&self, body: D::Body<'c>) {
        *self.body.lock().unwrap_or_else(|e| e.into_inner()) = Some(body);
    }

    /// Gives the body back after ending its savepoints: those still open are rolled back to.
    fn give_back_nested(&self, nested: D::Nested<'c>) {
        self.give_back(D::unnest(nested));
    }

    /// The statements of the body's server: on the MySQL protocol its family, asked on the
    /// body's connection (a connection does not say which server it came from).
    async fn statements(&self, nested: &mut D::Nested<'c>) -> &'static Sql {
        let mut body = D::nested_body(nested);
        Sql::of(learn_flavour(&mut D::on_body(&mut body), self.dialect, None).await)
    }

    async fn claim_nested(&self, req: &Request) -> Result<Claim<NestedClaim<'c, D>>, Error> {
        let mut nested = D::nest(self.take()?);
        let sql = self.statements(&mut nested).await;
        if let Err(e) = D::savepoint(&mut nested).await {
            self.give_back_nested(nested);
            return Err(db_error::<D>("beginning the nested claim's savepoint", e));
        }
        // The body's own savepoint is taken below, as one more level.
        let step: ClaimStep = claim_step(req, false);
        let claimed = {
            let mut body = D::nested_body(&mut nested);
            claim::<D, _>(&mut D::on_body(&mut body), sql, &step).await
        };
        let row = match claimed {
            Ok(Claimed::Execute) => {
                let body = req.savepoint();
                if body && let Err(e) = D::savepoint(&mut nested).await {
                    self.give_back_nested(nested);
                    return Err(db_error::<D>("taking the claim savepoint", e));
                }
                return Ok(Claim::Execute(NestedClaim {
                    nested,
                    owner: step.row.owner,
                    sql,
                    body,
                }));
            }
            Ok(Claimed::InFlight) => None,
            Ok(Claimed::Live(row) | Claimed::LiveLocked(row)) => Some(row),
            Err(fault) => {
                self.give_back_nested(nested);
                return Err(failed::<D>(fault));
            }
        };
        // Nothing of the claim is kept: the outer transaction goes on as before it.
        let ended = D::end_savepoint(&mut nested, false).await;
        self.give_back_nested(nested);
        ended.map_err(|e| db_error::<D>("ending the nested claim's savepoint", e))?;
        match row {
            None => Ok(Claim::InFlight),
            Some(row) => live_answer(row),
        }
    }

    async fn record_nested(
        &self,
        mut claim: NestedClaim<'c, D>,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        let recorded = async {
            if claim.body {
                // A final error keeps only the recorded error: the body's writes are undone.
                D::end_savepoint(&mut claim.nested, status != RecordStatus::Failed)
                    .await
                    .map_err(|e| db_error::<D>("rolling back the handler's writes", e))?;
            }
            let row = NewRecord::of(req, claim.owner, req.ttl());
            let record = claim.sql.ledger.record(&row, status.code(), payload);
            let updated = {
                let mut body = D::nested_body(&mut claim.nested);
                crate::Connection::execute(&mut D::on_body(&mut body), record)
                    .await
                    .map_err(|e| db_error::<D>("recording the result", e))?
            };
            if updated != 1 {
                return Err(crate::claim_lost());
            }
            D::end_savepoint(&mut claim.nested, true)
                .await
                .map_err(|e| db_error::<D>("keeping the nested call", e))
        }
        .await;
        // On an error the savepoints still open are rolled back to: nothing of the call stays.
        self.give_back_nested(claim.nested);
        recorded
    }

    /// A savepoint that claims nothing, for a call run with idem switched off or observed.
    async fn begin_nested(&self) -> Result<NestedClaim<'c, D>, Error> {
        let mut nested = D::nest(self.take()?);
        if let Err(e) = D::savepoint(&mut nested).await {
            self.give_back_nested(nested);
            return Err(db_error::<D>("beginning the handler's savepoint", e));
        }
        let sql = self.statements(&mut nested).await;
        Ok(NestedClaim {
            nested,
            owner: 0,
            sql,
            body: false,
        })
    }

    async fn end_nested(
        &self,
        claim: NestedClaim<'c, D>,
        keep: bool,
        doing: &str,
    ) -> Result<(), Error> {
        let mut nested = claim.nested;
        if claim.body {
            // The body's savepoint inside the claim's: kept with it, or undone with it.
            if let Err(e) = D::end_savepoint(&mut nested, keep).await {
                self.give_back_nested(nested);
                return Err(db_error::<D>(doing, e));
            }
        }
        let ended = D::end_savepoint(&mut nested, keep).await;
        self.give_back_nested(nested);
        ended.map_err(|e| db_error::<D>(doing, e))
    }
}

/// A key claimed in a savepoint of another call's transaction.
pub struct NestedClaim<'c, D: Driver> {
    nested: D::Nested<'c>,
    owner: i64,
    sql: &'static Sql,
    /// Whether the body runs in a savepoint of its own inside the claim's, where a final
    /// error rolls the body's writes back to.
    body: bool,
}

impl<D: Driver> std::fmt::Debug for NestedClaim<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NestedClaim")
            .field("owner", &self.owner)
            .field("body_savepoint", &self.body)
            .finish_non_exhaustive()
    }
}

/// idem-core's [`Store`] for a nested body, owned (`Nested`) or lent by the connection value
/// that holds it (`&Nested`), written once.
macro_rules! nested_store {
    ([$($lt:lifetime),*] $store:ty) => {
        impl<$($lt,)* 'c, D: Driver> Store for $store {
            type Tx<'t> = D::Body<'t>;
            type Claimed = NestedClaim<'c, D>;

            fn tx<'t>(claimed: &'t mut NestedClaim<'c, D>) -> D::Body<'t> {
                D::nested_body(&mut claimed.nested)
            }

            async fn claim(&self, req: &Request) -> Result<Claim<NestedClaim<'c, D>>, Error> {
                // Not detached: the outer transaction is borrowed, and a caller that stops
                // waiting drops the outer call with it.
                self.claim_nested(req).await
            }

            async fn record(
                &self,
                claimed: NestedClaim<'c, D>,
                req: &Request,
                status: RecordStatus,
                payload: &[u8],
            ) -> Result<(), Error> {
                self.record_nested(claimed, req, status, payload).await
            }

            async fn release(&self, claimed: NestedClaim<'c, D>) -> Result<(), Error> {
                self.end_nested(claimed, false, "releasing the key").await
            }

            async fn aborted(&self, claimed: &mut NestedClaim<'c, D>, req: &Request) -> bool {
                // As on the pool: on MySQL a conflict rolled the whole outer transaction back,
                // with the claim's row.
                let mut body = D::nested_body(&mut claimed.nested);
                claim_aborted::<D>(&mut D::on_body(&mut body), claimed.sql, claimed.owner, req)
                    .await
            }

            async fn begin(&self) -> Result<NestedClaim<'c, D>, Error> {
                self.begin_nested().await
            }

            async fn commit(&self, claimed: NestedClaim<'c, D>) -> Result<(), Error> {
                self.end_nested(claimed, true, "committing the handler's writes")
                    .await
            }

            fn ledger_identity(&self) -> Option<usize> {
                // A nested claim's record is seen by others only when the outer call commits:
                // its duplicates in this process cannot wait for it in memory.
                None
            }
        }
    };
}

nested_store!([] Nested<'c, D>);
nested_store!(['a] &'a Nested<'c, D>);

/// The store of a connection that is either a pool (at the top of a request: the claim
/// begins a transaction of its own) or another call's body (nested: the claim is a savepoint
/// in it). `N` is the nested store: a [`Nested`] owned, or lent (`&Nested`) by a connection
/// value that holds it.
#[derive(Debug)]
pub enum ConnStore<D: Driver, N> {
    /// On the pool.
    Pool(SqlStore<D>),
    /// In another call's body.
    Nested(N),
}

impl<D: Driver, N> ConnStore<D, N> {
    /// The store on a pool (`&DatabaseConnection`, `&PgPool`, ...).
    pub fn new(pool: impl Into<D>) -> Self {
        ConnStore::Pool(SqlStore::new(pool.into()))
    }
}

impl<'c, D: Driver> ConnStore<D, Nested<'c, D>> {
    /// The store whose claims are savepoints inside another call's `body`: they commit when
    /// the body's transaction does.
    pub fn nested(body: D::Body<'c>) -> Self {
        ConnStore::Nested(Nested::new(body))
    }
}

/// A key claimed through a [`ConnStore`]: `C` is the nested store's claim.
#[derive(Debug)]
pub enum ConnClaimed<D: Driver, C> {
    /// In a transaction of its own on the pool.
    Pool(ClaimedTx<D>),
    /// In a savepoint of another call's transaction.
    Nested(C),
}

/// A claim handed back to a store of the other kind: the engine never does this.
fn mismatched() -> Error {
    Error::Store {
        message: "a claim was handed to a store of another kind".to_owned(),
        source: None,
    }
}

impl<D, N> Store for ConnStore<D, N>
where
    D: Driver,
    N: Store + for<'t> Store<Tx<'t> = D::Body<'t>>,
{
    type Tx<'t> = D::Body<'t>;
    type Claimed = ConnClaimed<D, N::Claimed>;

    fn tx(claimed: &mut Self::Claimed) -> D::Body<'_> {
        match claimed {
            ConnClaimed::Pool(claimed) => SqlStore::<D>::tx(claimed),
            ConnClaimed::Nested(claimed) => N::tx(claimed),
        }
    }

    async fn claim(&self, req: &Request) -> Result<Claim<Self::Claimed>, Error> {
        match self {
            ConnStore::Pool(store) => Ok(store.claim(req).await?.map_execute(ConnClaimed::Pool)),
            ConnStore::Nested(nested) => {
                Ok(nested.claim(req).await?.map_execute(ConnClaimed::Nested))
            }
        }
    }

    async fn record(
        &self,
        claimed: Self::Claimed,
        req: &Request,
        status: RecordStatus,
        payload: &[u8],
    ) -> Result<(), Error> {
        match (self, claimed) {
            (ConnStore::Pool(store), ConnClaimed::Pool(claimed)) => {
                store.record(claimed, req, status, payload).await
            }
            (ConnStore::Nested(nested), ConnClaimed::Nested(claimed)) => {
                nested.record(claimed, req, status, payload).await
            }
            _ => Err(mismatched()),
        }
    }

    async fn release(&self, claimed: Self::Claimed) -> Result<(), Error> {
        match (self, claimed) {
            (ConnStore::Pool(store), ConnClaimed::Pool(claimed)) => store.release(claimed).await,
            (ConnStore::Nested(nested), ConnClaimed::Nested(claimed)) => {
                nested.release(claimed).await
            }
            _ => Err(mismatched()),
        }
    }

    async fn aborted(&self, claimed: &mut Self::Claimed, req: &Request) -> bool {
        match (self, claimed) {
            (ConnStore::Pool(store), ConnClaimed::Pool(claimed)) => {
                store.aborted(claimed, req).await
            }
            (ConnStore::Nested(nested), ConnClaimed::Nested(claimed)) => {
                nested.aborted(claimed, req).await
            }
            _ => false,
        }
    }

    async fn begin(&self) -> Result<Self::Claimed, Error> {
        match self {
            ConnStore::Pool(store) => store.begin().await.map(ConnClaimed::Pool),
            ConnStore::Nested(nested) => nested.begin().await.map(ConnClaimed::Nested),
        }
    }

    async fn commit(&self, claimed: Self::Claimed) -> Result<(), Error> {
        match (self, claimed) {
            (ConnStore::Pool(store), ConnClaimed::Pool(claimed)) => store.commit(claimed).await,
            (ConnStore::Nested(nested), ConnClaimed::Nested(claimed)) => {
                nested.commit(claimed).await
            }
            _ => Err(mismatched()),
        }
    }

    fn ledger_identity(&self) -> Option<usize> {
        match self {
            ConnStore::Pool(store) => store.ledger_identity(),
            ConnStore::Nested(nested) => nested.ledger_identity(),
        }
    }
}
