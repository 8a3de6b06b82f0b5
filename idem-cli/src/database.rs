//! Reaching the service's database, and checking that idem's tables are there before a
//! command reads them, so that a wrong URL or a database without them is one line naming the
//! fix.

use std::time::Duration;

use idem_sea_orm::sea_orm::{ConnectOptions, Database, DatabaseConnection};

use crate::Failure;

/// How long connecting (or waiting for a pooled connection) may take before the tool gives
/// up: an unreachable server is an error, not a hang.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The URL schemes the tool's drivers speak, as the URL's first part.
const SCHEMES: [&str; 4] = ["postgres", "postgresql", "mysql", "sqlite"];

/// Connects to `url`. The URL is never echoed: it may hold a password.
pub(crate) async fn connect(url: &str) -> Result<DatabaseConnection, Failure> {
    let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
    if !SCHEMES.contains(&scheme) {
        return Err(Failure(format!(
            "the database URL must start with postgres://, mysql:// (MariaDB) or sqlite:// \
            (got {}); check --url or DATABASE_URL",
            if scheme.is_empty() {
                "no scheme".to_owned()
            } else {
                format!("`{scheme}:`")
            }
        )));
    }
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .sqlx_logging(false)
        .connect_timeout(CONNECT_TIMEOUT)
        .acquire_timeout(CONNECT_TIMEOUT)
        .min_connections(0)
        .max_connections(2);
    Database::connect(options).await.map_err(|e| {
        // A refused connection is retried until the timeout: the driver then only says it
        // timed out, so say what that usually means.
        let what = if e.to_string().contains("timed out") {
            format!(
                "cannot connect to the {scheme} database within {}s (is the server up, and \
                are the host and port right?)",
                CONNECT_TIMEOUT.as_secs()
            )
        } else {
            format!("cannot connect to the {scheme} database")
        };
        Failure::caused(&what, &e)
    })
}

/// Fails unless `db` has every table of `needed`, naming the ones it lacks and how to
/// create them.
pub(crate) async fn require_tables(
    db: &DatabaseConnection,
    needed: &[&str],
) -> Result<(), Failure> {
    let missing: Vec<String> = idem_sea_orm::inspect::missing_tables(db)
        .await?
        .into_iter()
        .filter(|table| needed.contains(table))
        .map(|table| format!("`{table}`"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Failure(format!(
        "this database has no {} table{}: create idem's tables with \
        `idem::sea_orm::create_tables(&db)` at the service's startup or run its migrations \
        (`idem::sea_orm::migrations()` in your Migrator), or check that --url / DATABASE_URL \
        names the service's database",
        missing.join(", "),
        if missing.len() > 1 { "s" } else { "" }
    )))
}
