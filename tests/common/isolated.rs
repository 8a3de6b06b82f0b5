//! Databases of their own for tests that run a relay (it claims every message of its table):
//! a fresh SQLite file, PostgreSQL schema or MariaDB database per call.

use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection};

use super::{prepare, unique};

/// A database of a test's own.
pub struct Isolated {
    pub name: &'static str,
    pub db: DatabaseConnection,
    /// How another process reaches the same database.
    pub url: String,
}

/// Databases of their own for one test, on every backend of the run.
pub async fn isolated() -> Vec<Isolated> {
    let path = std::env::temp_dir().join(format!("{}.db", unique("idem-iso")));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let db = connect(&url).await;
    prepare(&db).await;
    let mut all = vec![Isolated {
        name: "sqlite",
        db,
        url,
    }];
    let namespace = unique("ob").replace('-', "_");
    if let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") {
        let admin = connect(&url).await;
        admin
            .execute_unprepared(&format!("CREATE SCHEMA {namespace}"))
            .await
            .expect("create schema");
        let sep = if url.contains('?') { '&' } else { '?' };
        let url = format!("{url}{sep}options=-c%20search_path%3D{namespace}");
        let db = connect(&url).await;
        prepare(&db).await;
        all.push(Isolated {
            name: "postgres",
            db,
            url,
        });
    }
    if let Ok(url) = std::env::var("IDEM_TEST_MYSQL_URL") {
        let admin = connect(&url).await;
        admin
            .execute_unprepared(&format!("CREATE DATABASE {namespace}"))
            .await
            .expect("create database");
        let base = url.rsplit_once('/').map_or(url.as_str(), |(base, _)| base);
        let url = format!("{base}/{namespace}");
        let db = connect(&url).await;
        prepare(&db).await;
        all.push(Isolated {
            name: "mysql",
            db,
            url,
        });
    }
    all
}

/// A pool on `url` (SQLite: one connection, as SeaORM's default).
pub async fn connect(url: &str) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .sqlx_logging(false)
        .max_connections(if url.starts_with("sqlite") { 1 } else { 16 });
    Database::connect(options)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url} (set by the environment): {e}"))
}
