//! Databases of their own for tests that run a relay (it claims every message of its table):
//! a fresh SQLite file, PostgreSQL schema or MariaDB database per call.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};

use super::{prepare, server_urls, sqlite_url, unique, with_sqlite};

/// A database of a test's own: a [`Backend`](super::Backend) whose `url` reaches only it.
pub use super::Backend as Isolated;

/// Databases of their own for one test, on every backend of the run.
pub async fn isolated() -> Vec<Isolated> {
    let mut all = Vec::new();
    if with_sqlite() {
        let url = sqlite_url("idem-iso");
        let db = connect(&url).await;
        prepare(&db).await;
        all.push(Isolated {
            name: "sqlite",
            db,
            url,
        });
    }
    let namespace = unique("ob").replace('-', "_");
    for (name, url) in server_urls() {
        let admin = connect(&url).await;
        drop_left_over(&admin, name).await;
        let url = if name == "postgres" {
            admin
                .execute_unprepared(&format!("CREATE SCHEMA {namespace}"))
                .await
                .expect("create schema");
            let sep = if url.contains('?') { '&' } else { '?' };
            format!("{url}{sep}options=-c%20search_path%3D{namespace}")
        } else {
            admin
                .execute_unprepared(&format!("CREATE DATABASE {namespace}"))
                .await
                .expect("create database");
            let base = url.rsplit_once('/').map_or(url.as_str(), |(base, _)| base);
            format!("{base}/{namespace}")
        };
        let db = connect(&url).await;
        prepare(&db).await;
        all.push(Isolated { name, db, url });
    }
    all
}

/// How long a test's own database may live: none runs this long, so an older one was left
/// by a run that ended (the tests do not drop theirs).
const LEFT_OVER_AFTER: Duration = Duration::from_secs(3600);

/// Drops the databases of their own that runs before this one left on `name`'s server:
/// those [`unique`] named over [`LEFT_OVER_AFTER`] ago (its name carries the time it was
/// made), so a run never takes a database another run, on any machine, still uses.
async fn drop_left_over(admin: &DatabaseConnection, name: &str) {
    let (list, drop) = if name == "postgres" {
        (
            "SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'ob\\_%'",
            "DROP SCHEMA IF EXISTS {} CASCADE",
        )
    } else {
        (
            "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'ob\\_%'",
            "DROP DATABASE IF EXISTS {}",
        )
    };
    let rows = admin
        .query_all_raw(Statement::from_string(admin.get_database_backend(), list))
        .await
        .expect("the databases of earlier runs");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    for row in rows {
        let namespace: String = row.try_get_by_index(0).expect("a name");
        // ob_{pid}_{nanoseconds since the epoch, in hex}_{n}
        let made = namespace
            .split('_')
            .nth(2)
            .and_then(|nanos| u128::from_str_radix(nanos, 16).ok())
            .map(|nanos| Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)));
        if made.is_some_and(|made| now.saturating_sub(made) > LEFT_OVER_AFTER) {
            // Tests of this run start together and find the same left-overs: one drops
            // each, and another's drop of it may fail once it is gone, which is the point.
            let _ = admin
                .execute_unprepared(&drop.replace("{}", &namespace))
                .await;
        }
    }
}

/// A pool on `url` (SQLite: one connection, as SeaORM's default; servers: 16).
pub async fn connect(url: &str) -> DatabaseConnection {
    super::connect(url, 16).await
}
