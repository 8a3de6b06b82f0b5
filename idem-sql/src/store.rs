//! The one store over a [`Driver`]: what idem's engine asks of a database (idem-core's store
//! traits), implemented once for every driver. It takes the stores' own implementations'
//! places feature by feature (`docs/plans/driver-port.md`); the completer's is the first
//! (`completer/store.rs`).

use std::future::Future;
use std::time::Duration;

use idem_core::Error;

use crate::driver::db_error;
use crate::{Begin, Dialect, Driver, Flavour, Handle, MySqlServer, Sql, learn_flavour};

/// idem's store on driver `D`: SeaORM's, sqlx's or tokio-postgres's pool. Cloning it shares
/// the pool.
#[derive(Clone, Debug)]
pub struct SqlStore<D> {
    driver: D,
}

impl<D: Driver> SqlStore<D> {
    /// The store on `driver`, or on a pool it converts from (`&DatabaseConnection`,
    /// `&PgPool`, ...). The ledger table must exist.
    pub fn new(driver: impl Into<D>) -> Self {
        SqlStore {
            driver: driver.into(),
        }
    }

    /// The driver the store runs on.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The statements every server of the driver's dialect runs alike (all but the atomic
    /// claim's, which differ by MySQL family).
    pub(crate) fn statements(&self) -> &'static Sql {
        Sql::common(self.driver.dialect())
    }

    /// Every statement of the server the driver's pool reaches: on the MySQL protocol, of its
    /// family, learnt once per server ([`learn_flavour`]; asked each time where the driver
    /// cannot name the server); an error says it happened while `doing`.
    pub(crate) async fn server_statements(
        &self,
        doing: &'static str,
    ) -> Result<&'static Sql, Error> {
        let dialect = self.driver.dialect();
        let flavour = match dialect {
            Dialect::Postgres => Flavour::Postgres,
            Dialect::Sqlite => Flavour::Sqlite,
            Dialect::MySql => {
                let server = self.driver.server();
                match server.as_ref().and_then(MySqlServer::learnt) {
                    Some(flavour) => flavour,
                    None => {
                        let mut conn = self.pooled(doing).await?;
                        learn_flavour(&mut conn, dialect, server.as_ref()).await
                    }
                }
            }
        };
        Ok(Sql::of(flavour))
    }

    /// A pooled connection; an error says it happened while `doing`.
    pub(crate) async fn pooled(&self, doing: &'static str) -> Result<D::Pooled, Error> {
        self.driver
            .acquire()
            .await
            .map_err(|e| db_error::<D>(doing, e))
    }

    /// A write transaction ([`Begin::Write`]); an error says it happened while `doing`.
    pub(crate) async fn begin_write(&self, doing: &'static str) -> Result<D::Tx, Error> {
        self.driver
            .begin(Begin::Write)
            .await
            .map_err(|e| db_error::<D>(doing, e))
    }
}

/// The store as the operator functions' handle: a pooled connection each (the relay reads the
/// outbox's health through it).
impl<D: Driver> Handle<D> for SqlStore<D> {
    type Conn<'h> = D::Pooled;

    fn dialect(&self) -> Dialect {
        self.driver.dialect()
    }

    fn connection(&self) -> impl Future<Output = Result<D::Pooled, D::Error>> + Send {
        self.driver.acquire()
    }

    fn driver(&self) -> Option<D> {
        Some(self.driver.clone())
    }
}

/// `work`, failing as a lost connection after `wait` (`None`: unbounded, SQLite): an
/// outage told promptly, as a lease's holder must hear of it.
pub(crate) async fn within<T>(
    wait: Option<Duration>,
    doing: &str,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    let Some(wait) = wait else {
        return work.await;
    };
    tokio::time::timeout(wait, work).await.unwrap_or_else(|_| {
        Err(Error::Unavailable {
            message: format!(
                "no database connection while {doing} (none within {} ms)",
                wait.as_millis()
            ),
            retry_after: Duration::from_secs(1),
        })
    })
}

/// Implements idem-core's `LeaseStore` and `ResumeStore` for a store crate's lease store by
/// lending the [`SqlStore`] its `generic()` method returns: `lend_store!([DB: Backend]
/// SqlxLeaseStore<DB>)`. The lease stores keep their own names and constructors for users;
/// everything they do is written once, here.
#[doc(hidden)]
#[macro_export]
macro_rules! lend_store {
    ([$($generics:tt)*] $store:ty) => {
        impl<$($generics)*> ::idem_core::LeaseStore for $store {
            fn claim_lease<'a>(
                &'a self,
                req: &'a ::idem_core::Request,
                lease: ::std::time::Duration,
            ) -> ::idem_core::BoxFuture<'a, Result<::idem_core::LeaseClaim, ::idem_core::Error>> {
                ::idem_core::LeaseStore::claim_lease(self.generic(), req, lease)
            }

            fn renew<'a>(
                &'a self,
                ticket: &'a ::idem_core::Ticket,
                lease: ::std::time::Duration,
            ) -> ::idem_core::BoxFuture<'a, Result<(), ::idem_core::Error>> {
                ::idem_core::LeaseStore::renew(self.generic(), ticket, lease)
            }

            fn record_step<'a>(
                &'a self,
                ticket: &'a ::idem_core::Ticket,
                name: &'a str,
                payload: &'a [u8],
            ) -> ::idem_core::BoxFuture<'a, Result<(), ::idem_core::Error>> {
                ::idem_core::LeaseStore::record_step(self.generic(), ticket, name, payload)
            }

            fn complete<'a>(
                &'a self,
                ticket: &'a ::idem_core::Ticket,
                req: &'a ::idem_core::Request,
                status: ::idem_core::RecordStatus,
                payload: &'a [u8],
                steps: &'a [String],
            ) -> ::idem_core::BoxFuture<'a, Result<(), ::idem_core::Error>> {
                ::idem_core::LeaseStore::complete(self.generic(), ticket, req, status, payload, steps)
            }

            fn release_lease<'a>(
                &'a self,
                ticket: &'a ::idem_core::Ticket,
            ) -> ::idem_core::BoxFuture<'a, Result<(), ::idem_core::Error>> {
                ::idem_core::LeaseStore::release_lease(self.generic(), ticket)
            }
        }

        impl<$($generics)*> ::idem_core::completer::ResumeStore for $store {
            fn due_calls<'a>(
                &'a self,
                scopes: &'a [&'a str],
                limit: u32,
            ) -> ::idem_core::BoxFuture<'a, Result<::idem_core::completer::Due, ::idem_core::Error>> {
                ::idem_core::completer::ResumeStore::due_calls(self.generic(), scopes, limit)
            }

            fn begin_attempt<'a>(
                &'a self,
                call: &'a ::idem_core::completer::StoredCall,
                backoff: ::std::time::Duration,
            ) -> ::idem_core::BoxFuture<'a, Result<bool, ::idem_core::Error>> {
                ::idem_core::completer::ResumeStore::begin_attempt(self.generic(), call, backoff)
            }

            fn note_failure<'a>(
                &'a self,
                call: &'a ::idem_core::completer::StoredCall,
                error: &'a str,
            ) -> ::idem_core::BoxFuture<'a, Result<(), ::idem_core::Error>> {
                ::idem_core::completer::ResumeStore::note_failure(self.generic(), call, error)
            }

            fn give_up<'a>(
                &'a self,
                call: &'a ::idem_core::completer::StoredCall,
                payload: &'a [u8],
                hook_retry: ::std::time::Duration,
            ) -> ::idem_core::BoxFuture<'a, Result<bool, ::idem_core::Error>> {
                ::idem_core::completer::ResumeStore::give_up(self.generic(), call, payload, hook_retry)
            }

            fn steps<'a>(
                &'a self,
                call: &'a ::idem_core::completer::StoredCall,
            ) -> ::idem_core::BoxFuture<'a, Result<::idem_core::completer::Steps, ::idem_core::Error>> {
                ::idem_core::completer::ResumeStore::steps(self.generic(), call)
            }

            fn forget<'a>(
                &'a self,
                call: &'a ::idem_core::completer::StoredCall,
            ) -> ::idem_core::BoxFuture<'a, Result<(), ::idem_core::Error>> {
                ::idem_core::completer::ResumeStore::forget(self.generic(), call)
            }

            fn unregistered<'a>(
                &'a self,
                scopes: &'a [&'a str],
            ) -> ::idem_core::BoxFuture<'a, Result<Vec<(String, u64)>, ::idem_core::Error>> {
                ::idem_core::completer::ResumeStore::unregistered(self.generic(), scopes)
            }
        }
    };
}
