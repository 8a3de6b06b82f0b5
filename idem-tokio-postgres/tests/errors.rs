//! What the driver's errors read as, to the operator who finds them in a log: a statement's
//! error as PostgreSQL's own words, not as a failure to connect. Needs
//! `IDEM_TEST_POSTGRES_URL`; skipped without it.

use std::error::Error as _;
use std::time::Duration;

use deadpool_postgres::{Manager, Pool, Runtime};
use idem_tokio_postgres::tokio_postgres;

/// `error` and every cause below it, one per line.
fn chain(error: &idem_core::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push('\n');
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

#[tokio::test]
async fn a_statement_error_reads_as_the_statement_s() {
    let Ok(url) = std::env::var("IDEM_TEST_POSTGRES_URL") else {
        return;
    };
    // A schema of this test's own whose ledger lacks the purge's columns: the purge's
    // statement fails on the server, on a connection that works.
    let schema = format!("errors_{}", std::process::id());
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("the server at IDEM_TEST_POSTGRES_URL");
    tokio::spawn(connection);
    admin
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
             CREATE TABLE {schema}.idem_ledger (id BYTEA PRIMARY KEY)"
        ))
        .await
        .expect("the schema");
    let mut config: tokio_postgres::Config = url.parse().expect("a PostgreSQL URL");
    config.options(format!("-c search_path={schema}"));
    let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
        .max_size(1)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(5)))
        .build()
        .expect("a pool");

    let purged = idem_tokio_postgres::purge_expired(&pool, 10).await;
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("the schema dropped");

    let error = purged.expect_err("the purge meets a ledger without its columns");
    let text = chain(&error);
    assert!(
        text.contains("does not exist"),
        "PostgreSQL's words: {text}"
    );
    assert!(
        !text.contains("creating a new object"),
        "a statement's error is not a failed connect: {text}"
    );
}
