//! P8 and P9: the outbox relay against a hand-written polling relay, measured in the same
//! run on the same table and the same JetStream stream.
//!
//! - P8 throughput: N committed messages, time until all are published and acknowledged by
//!   JetStream: idem's relay (1 and 4 relays) against the relay people write by hand (select a
//!   batch, publish each and wait for its ack, update each row).
//! - P9 commit-to-publish latency: one message per `#[idempotent]` call, at a steady rate;
//!   time from the call's return (committed) to its arrival at a NATS subscriber: idem's relay
//!   (woken by the commit) against the hand-written relay polling every 100 ms.
//!
//! Both need a nats-server with JetStream at `NATS_URL` (default `nats://127.0.0.1:4222`); the
//! figures use a stream of their own (`BENCH_OUTBOX`, subjects `bench.outbox.>`), recreated each
//! run. Without the server they are reported as not measured, with the reason.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use idem::idempotent;
use idem::nats::{JetStreamSink, async_nats};
use idem::outbox::Message;
use idem::sea_orm::{Outbox, Relay, outbox_health};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement, TransactionTrait};

use crate::setup::{Bench, Plan};
use crate::{BoxError, Res};

/// Where the figures look for NATS when `NATS_URL` is not set.
const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// The subjects the figures publish on; the stream captures them.
const SUBJECTS: &str = "bench.outbox.>";
const STREAM: &str = "BENCH_OUTBOX";
const PAYLOAD: &[u8] = &[b'x'; 256];

/// P8's figures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Throughput {
    pub(crate) messages: usize,
    pub(crate) idem_1_relay_per_s: f64,
    pub(crate) idem_4_relays_per_s: f64,
    pub(crate) idem_4_relays_50_aggregates_per_s: f64,
    pub(crate) hand_written_per_s: f64,
}

impl Throughput {
    /// idem's single relay against the hand-written one (goal ≥ 3).
    pub(crate) fn ratio(&self) -> f64 {
        self.idem_1_relay_per_s / self.hand_written_per_s
    }
}

/// P9's figures, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Latency {
    pub(crate) messages: usize,
    pub(crate) wake_p50_ms: f64,
    pub(crate) wake_p99_ms: f64,
    pub(crate) polling_p50_ms: f64,
    pub(crate) polling_p99_ms: f64,
}

/// A connected JetStream context with a fresh, empty stream for the figures.
async fn jetstream(url: &str) -> Res<async_nats::jetstream::Context> {
    let client = async_nats::connect(url).await?;
    let js = async_nats::jetstream::new(client);
    let _ = js.delete_stream(STREAM).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: STREAM.to_owned(),
        subjects: vec![SUBJECTS.to_owned()],
        ..Default::default()
    })
    .await?;
    Ok(js)
}

async fn clear(db: &DatabaseConnection) -> Res<()> {
    db.execute_unprepared("DELETE FROM idem_outbox").await?;
    db.execute_unprepared("DELETE FROM idem_outbox_heads")
        .await?;
    Ok(())
}

async fn stage_batch(db: &DatabaseConnection, n: usize, aggregates: Option<usize>) -> Res<()> {
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        let tx = db.begin().await?;
        for &i in chunk {
            let mut message = Message::new(format!("bench.outbox.m{}", i % 16), PAYLOAD.to_vec());
            if let Some(a) = aggregates {
                message = message.aggregate(format!("agg-{}", i % a));
            }
            tx.stage(message).await?;
        }
        tx.commit().await?;
    }
    Ok(())
}

async fn pending(db: &DatabaseConnection) -> Res<u64> {
    Ok(outbox_health(db).await?.pending)
}

/// `relays` idem relays running on tasks of their own (each made by `relay()`), until
/// [`Relays::stop`].
struct Relays {
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), idem::Error>>>,
}

impl Relays {
    fn start(relays: usize, relay: impl Fn() -> Relay<JetStreamSink>) -> Self {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let spawn = |_| {
            let (relay, mut stopped) = (relay(), stopped.clone());
            tokio::spawn(async move {
                let stopped = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                relay.run(stopped).await
            })
        };
        let tasks = (0..relays).map(spawn).collect();
        Self { stop, tasks }
    }

    async fn stop(self) -> Res<()> {
        self.stop.send(true)?;
        for t in self.tasks {
            t.await??;
        }
        Ok(())
    }
}

/// Runs `relays` idem relays until the outbox is empty; messages per second.
async fn idem_drain(
    db: &DatabaseConnection,
    js: &async_nats::jetstream::Context,
    relays: usize,
    n: usize,
) -> Res<f64> {
    let started = Instant::now();
    let running = Relays::start(relays, || {
        Relay::new(db.clone(), JetStreamSink::new(js.clone()))
            .batch_size(100)
            .poll_interval(Duration::from_millis(5))
    });
    while pending(db).await? > 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed();
    running.stop().await?;
    Ok(n as f64 / elapsed.as_secs_f64())
}

/// The relay people write by hand: select a batch, publish each message and wait for its
/// ack, mark each row. Returns how many it published; stops when a select comes back empty
/// (after polling every `poll` while `keep_polling` holds).
async fn hand_written(
    db: &DatabaseConnection,
    js: &async_nats::jetstream::Context,
    poll: Duration,
    keep_polling: impl Fn() -> bool,
) -> Res<usize> {
    let backend = db.get_database_backend();
    let select = "SELECT id, message_id, topic, payload FROM idem_outbox WHERE state = 0 ORDER BY id LIMIT 100";
    let mark = idem::sea_orm::placeholders(
        backend,
        "UPDATE idem_outbox SET state = 1, published_at_ms = 0 WHERE id = ?",
    );
    let mut published = 0;
    loop {
        let rows = db
            .query_all_raw(Statement::from_string(backend, select))
            .await?;
        if rows.is_empty() {
            if !keep_polling() {
                return Ok(published);
            }
            tokio::time::sleep(poll).await;
            continue;
        }
        for row in rows {
            let id: i64 = row.try_get_by_index(0)?;
            let message_id: String = row.try_get_by_index(1)?;
            let topic: String = row.try_get_by_index(2)?;
            let payload: Vec<u8> = row.try_get_by_index(3)?;
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(idem::nats::MESSAGE_ID_HEADER, message_id.as_str());
            js.publish_with_headers(topic, headers, payload.into())
                .await?
                .await?;
            db.execute_raw(Statement::from_sql_and_values(
                backend,
                mark.as_str(),
                [id.into()],
            ))
            .await?;
            published += 1;
        }
    }
}

/// P8: N committed messages through each relay variant.
async fn throughput(
    db: &DatabaseConnection,
    js: &async_nats::jetstream::Context,
    n: usize,
) -> Res<Throughput> {
    clear(db).await?;
    stage_batch(db, n, None).await?;
    let started = Instant::now();
    let published = hand_written(db, js, Duration::ZERO, || false).await?;
    let hand_written_per_s = published as f64 / started.elapsed().as_secs_f64();
    assert_eq!(published, n, "the hand-written relay published everything");

    // 1 relay, 4 relays, 4 relays over 50 aggregates.
    let mut idem = Vec::with_capacity(3);
    for (relays, aggregates) in [(1, None), (4, None), (4, Some(50))] {
        clear(db).await?;
        stage_batch(db, n, aggregates).await?;
        idem.push(idem_drain(db, js, relays, n).await?);
    }
    clear(db).await?;
    Ok(Throughput {
        messages: n,
        idem_1_relay_per_s: idem[0],
        idem_4_relays_per_s: idem[1],
        idem_4_relays_50_aggregates_per_s: idem[2],
        hand_written_per_s,
    })
}

#[derive(Debug, serde::Serialize)]
struct Tick {
    key: String,
    n: usize,
}

#[idempotent(scope = "bench.outbox.tick", key = tick.key)]
async fn tick(db: &DatabaseConnection, tick: Tick) -> Result<String, idem::Error> {
    db.stage(Message::new(
        format!("bench.outbox.t{}", tick.n % 16),
        PAYLOAD.to_vec(),
    ))
    .await
}

/// Stages one message per call every `interval` and measures commit-to-arrival.
async fn latencies(
    db: &DatabaseConnection,
    client: &async_nats::Client,
    n: usize,
    interval: Duration,
    run: &str,
) -> Res<Vec<f64>> {
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut subscriber = client.subscribe("bench.outbox.>").await?;
    client.flush().await?;
    let collector = {
        let committed = committed.clone();
        tokio::spawn(async move {
            let mut samples = Vec::with_capacity(n);
            while samples.len() < n {
                let Ok(Some(message)) =
                    tokio::time::timeout(Duration::from_secs(10), subscriber.next()).await
                else {
                    break;
                };
                let arrived = Instant::now();
                let Some(id) = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(idem::nats::MESSAGE_ID_HEADER))
                    .map(|v| v.as_str().to_owned())
                else {
                    continue;
                };
                // A message can arrive before its sender has noted the commit time.
                let deadline = Instant::now() + Duration::from_secs(1);
                loop {
                    let at = committed.lock().map(|m| m.get(&id).copied()).ok().flatten();
                    if let Some(at) = at {
                        samples.push(arrived.saturating_duration_since(at).as_secs_f64() * 1e3);
                        break;
                    }
                    if Instant::now() > deadline {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
            }
            samples
        })
    };
    let mut next = Instant::now();
    for i in 0..n {
        next += interval;
        let id = tick(
            db,
            Tick {
                key: format!("{run}-{i}"),
                n: i,
            },
        )
        .await?;
        let at = Instant::now();
        if let Ok(mut map) = committed.lock() {
            map.insert(id, at);
        }
        tokio::time::sleep_until(next.into()).await;
    }
    let mut samples = collector.await?;
    samples.sort_by(f64::total_cmp);
    Ok(samples)
}

/// P9's percentile of sorted samples: the sample at rank round((n - 1) * p). Not
/// `stats::percentile` (nearest rank, ceil(n * p)): P9 has been published with this one.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// P9: idem's relay (woken by each commit) against the hand-written relay polling every
/// 100 ms, at one message every 10 ms.
async fn latency(
    db: &DatabaseConnection,
    js: &async_nats::jetstream::Context,
    client: &async_nats::Client,
    n: usize,
) -> Res<Latency> {
    let interval = Duration::from_millis(10);
    let run = format!(
        "{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    );
    clear(db).await?;

    let relay = Relays::start(1, || Relay::new(db.clone(), JetStreamSink::new(js.clone())));
    let wake = latencies(db, client, n, interval, &format!("{run}-w")).await?;
    relay.stop().await?;

    clear(db).await?;
    let polling_on = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let poller = {
        let (db, js, on) = (db.clone(), js.clone(), polling_on.clone());
        tokio::spawn(async move {
            hand_written(&db, &js, Duration::from_millis(100), move || {
                on.load(std::sync::atomic::Ordering::Relaxed)
            })
            .await
        })
    };
    let polling = latencies(db, client, n, interval, &format!("{run}-p")).await?;
    polling_on.store(false, std::sync::atomic::Ordering::Relaxed);
    poller.await??;
    clear(db).await?;
    Ok(Latency {
        messages: wake.len().min(polling.len()),
        wake_p50_ms: percentile(&wake, 0.50),
        wake_p99_ms: percentile(&wake, 0.99),
        polling_p50_ms: percentile(&polling, 0.50),
        polling_p99_ms: percentile(&polling, 0.99),
    })
}

/// P8 and P9, or why they were not measured (the NATS server could not be reached, or has
/// no JetStream).
pub(crate) type OutboxFigures = Result<(Throughput, Latency), String>;

/// P8 then P9 on the bench's database, against the NATS server at `NATS_URL`. Only failing to
/// reach the server (or its JetStream) makes them "not measured"; any later failure is an
/// error, so a broken relay cannot pass for a missing server.
pub(crate) async fn measure(b: &Bench, plan: &Plan) -> Res<OutboxFigures> {
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned());
    let reached = async {
        let client = async_nats::connect(&nats_url).await?;
        let js = jetstream(&nats_url).await?;
        Ok::<_, BoxError>((client, js))
    }
    .await;
    let (client, js) = match reached {
        Ok(reached) => reached,
        Err(e) => {
            let reason = format!("NATS JetStream at {nats_url} unavailable: {e}");
            b.progress(&format!("outbox: P8 and P9 not measured ({reason})"));
            return Ok(Err(reason));
        }
    };
    let throughput = throughput(&b.db, &js, plan.relay_messages).await?;
    b.progress("outbox: relay throughput done");
    let latency = latency(&b.db, &js, &client, plan.publish_latency_messages).await?;
    b.progress("outbox: commit-to-publish latency done");
    Ok(Ok((throughput, latency)))
}
