//! The per-feature connection ports (`ClaimConnection`, `LeaseConnection`) over one [`Connection`], so that each store moves
//! onto the driver port on its own while the features' algorithms keep their ports. Rows are
//! decoded here, once, from the columns each statement declares; the ports go as the generic
//! store takes their places (`docs/plans/driver-port.md`, steps 3 to 9).

use std::marker::PhantomData;

use super::{Connection, Driver, Fault};
use crate::{Bound, ClaimConnection, ClaimRow, Failure, LeaseConnection, Row, read_step};

/// Connection `C` of driver `D` as every per-feature port: its rows decoded by the columns
/// their statements declare, its errors and idem's findings a [`Fault`].
#[derive(Debug)]
pub struct Bridge<C, D> {
    conn: C,
    driver: PhantomData<fn() -> D>,
}

impl<C, D> Bridge<C, D> {
    /// `conn` as the ports.
    pub fn new(conn: C) -> Self {
        Bridge {
            conn,
            driver: PhantomData,
        }
    }

    /// The connection back.
    pub fn into_inner(self) -> C {
        self.conn
    }
}

impl<C: Connection, D> Bridge<C, D> {
    /// Runs `statement`, answering the rows it changed.
    async fn run(&mut self, statement: Bound<'static>) -> Result<u64, Fault<C::Error>> {
        self.conn.execute(statement).await.map_err(Fault::Db)
    }

    /// Every row of `statement`, each read by `read`.
    async fn fetch_each<T>(
        &mut self,
        statement: Bound<'static>,
        read: fn(Row) -> Result<T, crate::Decode>,
    ) -> Result<Vec<T>, Fault<C::Error>> {
        super::fetch_each(&mut self.conn, statement, read).await
    }

    /// The first row of `statement`, if any, read by `read`.
    async fn fetch_first<T>(
        &mut self,
        statement: Bound<'static>,
        read: fn(Row) -> Result<T, crate::Decode>,
    ) -> Result<Option<T>, Fault<C::Error>> {
        super::fetch_first(&mut self.conn, statement, read).await
    }
}

impl<C, D> ClaimConnection for Bridge<C, D>
where
    C: Connection<Error = D::Error>,
    D: Driver,
{
    type Error = Fault<D::Error>;

    async fn fetch_row(
        &mut self,
        statement: Bound<'static>,
    ) -> Result<Option<ClaimRow>, Fault<D::Error>> {
        self.fetch_first(statement, ClaimRow::from_row).await
    }

    async fn execute_unprepared(&mut self, sql: &str) -> Result<(), Fault<D::Error>> {
        self.conn.execute_unprepared(sql).await.map_err(Fault::Db)
    }

    async fn execute(&mut self, statement: Bound<'static>) -> Result<u64, Fault<D::Error>> {
        self.run(statement).await
    }

    fn is_lock_timeout(error: &Fault<D::Error>) -> bool {
        error.failure(D::classify) == Failure::LockTimeout
    }

    fn row_not_found(what: &'static str) -> Fault<D::Error> {
        Fault::Missing(what)
    }
}

impl<C, D> LeaseConnection for Bridge<C, D>
where
    C: Connection<Error = D::Error>,
    D: Driver,
{
    async fn fetch_steps(
        &mut self,
        statement: Bound<'static>,
    ) -> Result<Vec<(String, Vec<u8>)>, Fault<D::Error>> {
        self.fetch_each(statement, read_step).await
    }
}
