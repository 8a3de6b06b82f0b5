//! A payments service over HTTP with idem: `cargo run --example payments`.
//!
//! SQLite file by default; `DATABASE_URL` picks PostgreSQL or MariaDB; `--addr` the listen
//! address (default 127.0.0.1:3000). Every POST and PATCH needs an `Idempotency-Key` header;
//! `PATCH /orders/{id}` (the order's note) also needs `If-Match` with the `ETag` that
//! `GET /orders/{id}` answers (428 without it, 412 once the order has changed).
//!
//! Paying an order stages a `shop.orders.paid` message in the payment's transaction. A relay
//! in this process publishes it: to JetStream stream `SHOP` (subjects `shop.>`, created if
//! missing) when `NATS_URL` is set, to RabbitMQ exchange `shop` (a topic exchange, with the
//! notifier's queue `notifier.receipts` bound to `shop.orders.paid`, declared if missing) when
//! `AMQP_URL` is set, else to the log. `cargo run --example notifier` consumes it.
//!
//! A pay whose process dies mid-call (its client gone too) is finished without the client: a
//! completer in this process takes over pays whose lease (30 s) ended unfinished, once they
//! are due, and records their answer for the client's late retry to replay. Several processes
//! may each run one (they share the work); `COMPLETER=off` runs none, leaving such pays to
//! their clients' retries.
//!
//! Answers are kept for `RECORD_TTL_SECS` seconds (default 86400, a day): a retry within it
//! replays. Every 10 s a purge deletes the records that outlived it, and the outbox messages
//! published longer ago.
//!
//! `GET /metrics` answers idem's counters per scope and outcome and its latency histogram in
//! the Prometheus text format (`curl localhost:3000/metrics`).

mod app;
#[path = "../shop/model.rs"]
mod model;
#[path = "../shop/service.rs"]
mod service;

use idem::nats::JetStreamSink;
use idem::outbox::LogSink;
use idem::rabbitmq::AmqpSink;
use idem::sea_orm::Relay;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use service::BoxError;
use tracing_subscriber::fmt::format::FmtSpan;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    service::init_tracing(FmtSpan::CLOSE);
    let addr = service::listen_addr("127.0.0.1:3000")?;
    // idem counts its calls through the `metrics` facade; this recorder keeps them for
    // `GET /metrics`. Latency buckets from 1 ms to 10 s.
    let metrics = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(idem::metrics::CALL_DURATION_SECONDS.to_owned()),
            &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
            ],
        )?
        .install_recorder()?;
    idem::metrics::describe();
    // `install_recorder` spawns no upkeep task: without one, every latency sample stays in
    // memory until the next `GET /metrics` renders it, and a process nobody scrapes grows
    // with every call.
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });

    if let Ok(secs) = std::env::var("RECORD_TTL_SECS") {
        let secs: u64 = secs.parse().map_err(|e| {
            format!("RECORD_TTL_SECS={secs:?}: {e}; give the records' TTL in seconds, e.g. 86400")
        })?;
        let _ = app::RECORD_TTL.set(std::time::Duration::from_secs(secs));
    }
    let (db, database) = service::database("payments").await?;
    app::create_tables(&db).await?;

    // The purge. Each statement deletes up to 500 rows in its own short transaction, and
    // the purge pauses as long as each took: claims wait behind one batch at most.
    let purge_db = db.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(10));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if let Err(e) = idem::sea_orm::purge_expired(&purge_db, 500).await {
                tracing::warn!(error = %e, "purging expired records failed; trying again in 10 s");
            }
            let published = idem::sea_orm::purge_published(&purge_db, app::record_ttl(), 500);
            if let Err(e) = published.await {
                tracing::warn!(error = %e, "purging published messages failed; trying again in 10 s");
            }
        }
    });

    // The relay publishes what paying stages: to JetStream with NATS_URL, else to the log.
    let relay_db = db.clone();
    tokio::spawn(async move {
        let nats = std::env::var("NATS_URL");
        let result = match (nats, std::env::var("AMQP_URL")) {
            (Err(_), Ok(amqp_url)) => match service::shop_queue(&amqp_url).await {
                Ok(()) => {
                    tracing::info!(exchange = "shop", "relaying the outbox to RabbitMQ");
                    Relay::new(relay_db, AmqpSink::new(amqp_url, "shop"))
                        .run(std::future::pending::<()>())
                        .await
                }
                Err(e) => Err(e),
            },
            (Ok(nats_url), _) => match service::shop_stream(&nats_url).await {
                Ok(jetstream) => {
                    tracing::info!(%nats_url, stream = "SHOP", "relaying the outbox to JetStream");
                    Relay::new(relay_db, JetStreamSink::new(jetstream))
                        .run(std::future::pending::<()>())
                        .await
                }
                Err(e) => Err(e),
            },
            (Err(_), Err(_)) => {
                tracing::info!(
                    "relaying the outbox to the log (set NATS_URL for JetStream, AMQP_URL for RabbitMQ)"
                );
                Relay::new(relay_db, LogSink)
                    .run(std::future::pending::<()>())
                    .await
            }
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "the outbox relay stopped");
        }
    });

    // The gateway: the `gateway` example over HTTP with GATEWAY_URL, else simulated in-process.
    let gateway = match std::env::var("GATEWAY_URL") {
        Ok(gateway_url) => {
            tracing::info!(%gateway_url, "charging through the gateway service");
            app::Gateway::http(&gateway_url)
        }
        Err(_) => app::Gateway::default(),
    };
    let state = app::AppState { db, gateway };

    // The completer: finishes pays abandoned mid-call (see `app::completer`).
    if std::env::var("COMPLETER").is_ok_and(|v| v == "off") {
        tracing::warn!("COMPLETER=off: pays abandoned mid-call wait for their clients' retries");
    } else {
        tokio::spawn(app::completer(&state).run(std::future::pending()));
    }
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(%addr, %database, "payments service listening");
    let routes = app::router(state).merge(app::metrics_routes(metrics));
    axum::serve(listener, routes).await?;
    Ok(())
}
