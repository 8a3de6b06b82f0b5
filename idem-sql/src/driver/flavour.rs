//! The statements' flavour of the server a connection reaches: on the MySQL protocol, which
//! family it is, asked once per server.

use super::Connection;
use crate::{Bound, Column, Dialect, Flavour, MySqlServer, Row};

/// The statements' flavour for a server of `dialect` reached through `conn`: on the MySQL
/// protocol the family is asked of the server ([`crate::SELECT_VERSION`],
/// [`crate::SELECT_WSREP_ON`]) unless this process learnt it of `server` already, and kept
/// for `server` once it answers.
pub async fn learn_flavour<C: Connection>(
    conn: &mut C,
    dialect: Dialect,
    server: Option<&MySqlServer>,
) -> Flavour {
    match dialect {
        Dialect::Postgres => Flavour::Postgres,
        Dialect::Sqlite => Flavour::Sqlite,
        Dialect::MySql => {
            if let Some(flavour) = server.and_then(MySqlServer::learnt) {
                return flavour;
            }
            // A failed query says "no": only a Galera-aware MariaDB knows `@@wsrep_on`.
            let ask_wsrep = Bound::unbound(crate::SELECT_WSREP_ON).reads(&[Column::I64]);
            let wsrep_on = scalar(conn, ask_wsrep)
                .await
                .and_then(|row| row.read().i64().ok());
            let ask_version = Bound::unbound(crate::SELECT_VERSION).reads(&[Column::Text]);
            let version = scalar(conn, ask_version)
                .await
                .and_then(|row| row.read().text().ok());
            match server {
                Some(server) => server.learn(version.as_deref(), wsrep_on),
                None => crate::mysql_flavour(version.as_deref(), wsrep_on),
            }
        }
    }
}

/// The one row `statement` returns, or `None` when it fails or returns none.
async fn scalar<C: Connection>(conn: &mut C, statement: Bound<'static>) -> Option<Row> {
    conn.fetch_optional(statement).await.ok().flatten()
}
