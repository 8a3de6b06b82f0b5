//! The one store over a [`Driver`]: what idem's engine asks of a database (idem-core's store
//! traits), implemented once for every driver. It takes the stores' own implementations'
//! places feature by feature (`docs/plans/driver-port.md`); the completer's is the first
//! (`completer/store.rs`).

use idem_core::Error;

use crate::{Begin, Driver, Fault, Sql};

/// idem's store on driver `D`: SeaORM's, sqlx's or tokio-postgres's pool. Cloning it shares
/// the pool.
#[derive(Clone, Debug)]
pub struct SqlStore<D> {
    driver: D,
}

impl<D: Driver> SqlStore<D> {
    /// The store on `driver`.
    pub fn new(driver: D) -> Self {
        SqlStore { driver }
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

/// The driver's error met while `doing` something, as idem's.
pub(crate) fn db_error<D: Driver>(doing: &str, error: D::Error) -> Error {
    failed::<D>((doing, Fault::Db(error)))
}

/// A step's failure, with what it was doing, as idem's error.
pub(crate) fn failed<D: Driver>((doing, fault): (&str, Fault<D::Error>)) -> Error {
    fault.into_error(doing, D::classify, D::CREATE_TABLES)
}
