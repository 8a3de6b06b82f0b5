//! A payments service over HTTP with idem: `cargo run --example payments`.
//!
//! SQLite file by default; `DATABASE_URL` picks PostgreSQL or MariaDB; `--addr` the listen
//! address (default 127.0.0.1:3000). Every POST needs an `Idempotency-Key` header.

mod app;
#[path = "../shop/model.rs"]
mod model;

use sea_orm::{ConnectOptions, Database};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // One line per idempotent call when its span closes: scope, key hash, outcome, duration.
    tracing_subscriber::fmt()
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();

    let mut args = std::env::args().skip(1);
    let mut addr = "127.0.0.1:3000".to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => {
                addr = args
                    .next()
                    .ok_or("--addr needs a value, e.g. 127.0.0.1:3000")?
            }
            other => {
                return Err(
                    format!("unknown argument `{other}`; expected --addr HOST:PORT").into(),
                );
            }
        }
    }
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        let path = std::env::temp_dir().join("idem-payments.db");
        format!("sqlite://{}?mode=rwc", path.display())
    });
    let mut options = ConnectOptions::new(url.clone());
    options.sqlx_logging(false);
    let db = Database::connect(options).await?;
    app::create_tables(&db).await?;

    let state = app::AppState {
        db,
        gateway: app::Gateway::default(),
    };
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(%addr, database = %url.split('?').next().unwrap_or_default(), "payments service listening");
    axum::serve(listener, app::router(state)).await?;
    Ok(())
}
