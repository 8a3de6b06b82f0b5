//! A database as users hold it (a SeaORM `DatabaseConnection` or transaction, a sqlx `Pool`),
//! handed to idem's operator functions: the purge, the inspection, the pre-deploy check. Each
//! driver crate implements [`Handle`] for its handle types, so those functions are written
//! once, here, and each store re-exports them under the names its users call.

use std::future::Future;

use idem_core::Error;

use super::{Connection, Driver};
use crate::driver::db_error;
use crate::{Dialect, Sql};

/// A handle of driver `D`'s: a pool, or a transaction the caller holds. The driver is a
/// parameter, not an associated type, so that a driver crate may implement it for a type of
/// the driver's (`impl Handle<Sqlx<DB>> for Pool<DB>`: the orphan rule allows it because
/// `Sqlx` is the crate's own); a call site infers `D` from the one impl its handle has.
pub trait Handle<D: Driver>: Sync {
    /// Where the handle runs statements: a pooled connection (each statement commits alone),
    /// or the caller's transaction.
    type Conn<'h>: Connection<Error = D::Error>
    where
        Self: 'h;

    /// The dialect of the handle's server.
    fn dialect(&self) -> Dialect;

    /// A connection to run statements on.
    fn connection(&self) -> impl Future<Output = Result<Self::Conn<'_>, D::Error>> + Send;

    /// The pool as a driver, to begin transactions of its own (the inspection's read-only
    /// snapshot); `None` for a transaction, whose reads run in it.
    fn driver(&self) -> Option<D> {
        None
    }
}

/// `db`'s connection and the statements every server of its dialect runs; an error says it
/// happened while `doing`.
pub(crate) async fn connect<'h, D: Driver, H: Handle<D>>(
    db: &'h H,
    doing: &'static str,
) -> Result<(H::Conn<'h>, &'static Sql), Error> {
    let conn = db.connection().await.map_err(|e| db_error::<D>(doing, e))?;
    Ok((conn, Sql::common(db.dialect())))
}
