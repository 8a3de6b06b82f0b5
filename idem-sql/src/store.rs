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
