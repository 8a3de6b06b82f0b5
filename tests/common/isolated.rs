//! Databases of their own for tests that run a relay (it claims every message of its table):
//! a fresh SQLite file, PostgreSQL schema or MariaDB database per call.

use sea_orm::{ConnectionTrait, DatabaseConnection};

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

/// A pool on `url` (SQLite: one connection, as SeaORM's default; servers: 16).
pub async fn connect(url: &str) -> DatabaseConnection {
    super::connect(url, 16).await
}
