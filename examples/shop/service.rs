//! What the shop's services (`payments`, `gateway`, `notifier`) share and do not demonstrate:
//! the log, `--addr`, the database (`DATABASE_URL`), stream `SHOP`, and how their errors become
//! problem+json answers. Included by each service's `main` and by the tests that include
//! `payments/app.rs`.

#![allow(dead_code)] // each includer uses its own part of this shared module

use axum::response::{IntoResponse, Response};
use idem::axum::Problem;
use idem::nats::{async_nats, ensure_stream};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbErr, EntityTrait, Schema,
};
use tracing_subscriber::fmt::format::FmtSpan;

/// What a service's `main` returns.
pub(crate) type BoxError = Box<dyn std::error::Error>;

/// Logs to stderr, filtered by `RUST_LOG` (default `info,sqlx=warn`), with the span events
/// `spans` (`FmtSpan::CLOSE`: one line per idempotent call when its span closes: scope, key
/// hash, outcome, duration).
pub(crate) fn init_tracing(spans: FmtSpan) {
    tracing_subscriber::fmt()
        .with_span_events(spans)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
}

/// The address to listen on: `--addr HOST:PORT`, else `default`; any other argument is an
/// error.
pub(crate) fn listen_addr(default: &str) -> Result<String, BoxError> {
    let mut args = std::env::args().skip(1);
    let mut addr = default.to_owned();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => {
                addr = args
                    .next()
                    .ok_or_else(|| format!("--addr needs a value, e.g. {default}"))?
            }
            other => {
                return Err(
                    format!("unknown argument `{other}`; expected --addr HOST:PORT").into(),
                );
            }
        }
    }
    Ok(addr)
}

/// The service's database: `DATABASE_URL`, else the SQLite file `idem-<name>.db` in the temp
/// directory, without statement logging; and its URL without the query, for the log.
pub(crate) async fn database(name: &str) -> Result<(DatabaseConnection, String), BoxError> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| {
        let path = std::env::temp_dir().join(format!("idem-{name}.db"));
        format!("sqlite://{}?mode=rwc", path.display())
    });
    let mut options = ConnectOptions::new(url.clone());
    options.sqlx_logging(false);
    let db = Database::connect(options).await?;
    let shown = url.split('?').next().unwrap_or_default().to_owned();
    Ok((db, shown))
}

/// Creates idem's tables and `entity`'s table with its indexes, where they do not exist yet.
pub(crate) async fn create_tables<E: EntityTrait>(
    db: &DatabaseConnection,
    entity: E,
) -> Result<(), BoxError> {
    idem::sea_orm::create_tables(db).await?;
    let schema = Schema::new(db.get_database_backend());
    db.execute(schema.create_table_from_entity(entity).if_not_exists())
        .await?;
    for mut index in schema.create_index_from_entity(entity) {
        match db.execute(index.if_not_exists()).await {
            Ok(_) => {}
            // MySQL has no `CREATE INDEX IF NOT EXISTS` (sea-query leaves the clause out
            // there): the index an earlier start made answers "Duplicate key name" (1061).
            Err(e) if e.to_string().contains("Duplicate key name") => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Connects to NATS at `url` (retrying until it answers) and makes sure stream `SHOP`
/// captures `shop.>`.
pub(crate) async fn shop_stream(url: &str) -> Result<async_nats::jetstream::Context, idem::Error> {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(url)
        .await
        .map_err(|e| idem::Error::store(format!("connecting to NATS at {url}"), e))?;
    let jetstream = async_nats::jetstream::new(client);
    ensure_stream(&jetstream, "SHOP", &["shop.>"]).await?;
    Ok(jetstream)
}

/// The RabbitMQ side of the shop's events at `url`: topic exchange `shop`, and the notifier's
/// quorum queue `notifier.receipts` bound to `shop.orders.paid` (declared if missing, by
/// whichever service starts first, so no message is published before its queue exists).
pub(crate) async fn shop_queue(url: &str) -> Result<(), idem::Error> {
    idem::rabbitmq::declare(url, "shop", "notifier.receipts", "shop.orders.paid").await
}

/// The services' errors: idem's own, the database's, and their domain errors.
#[derive(Debug)]
pub(crate) enum ApiError {
    Idem(idem::Error),
    NotFound(String),
    Database,
    /// The gateway could not be reached or refused: transient, the key is released.
    Gateway(String),
}

impl From<idem::Error> for ApiError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl From<DbErr> for ApiError {
    fn from(e: DbErr) -> Self {
        tracing::error!(error = %e, "database error");
        Self::Database
    }
}

/// What a log line or a completer's record of a failed attempt says.
impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Idem(e) => write!(f, "{e}"),
            Self::NotFound(id) => write!(f, "no order `{id}`"),
            Self::Database => f.write_str("the database is unavailable"),
            Self::Gateway(detail) => write!(f, "the payment gateway did not answer: {detail}"),
        }
    }
}

impl ApiError {
    /// The problem+json answer of this error, whatever the framework: axum's `IntoResponse`
    /// below, actix-web's `ResponseError` in `payments/actix_app.rs`.
    pub(crate) fn problem(&self) -> Problem {
        match self {
            Self::Idem(e) => Problem::from(e),
            Self::NotFound(id) => {
                Problem::new(404, "not-found", "Not found", format!("no order `{id}`"))
            }
            Self::Database => Problem::new(
                503,
                "store",
                "Service unavailable",
                "the database is unavailable; retry later",
            ),
            Self::Gateway(detail) => {
                tracing::warn!(%detail, "gateway call failed");
                Problem::new(
                    502,
                    "gateway",
                    "Payment gateway unavailable",
                    "the payment gateway did not answer; retry with the same key",
                )
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.problem().into_response()
    }
}
