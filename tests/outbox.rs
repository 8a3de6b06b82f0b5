//! The outbox on every backend of the run: staging commits with the handler's writes (and a
//! replay stages nothing), the relay delivers each message once per success and keeps each
//! aggregate in commit order across relays, poison messages go dead without blocking other
//! aggregates, and a committed message wakes the relay. Every test counts rows or deliveries.
//!
//! A relay claims every message of its table, so each test gets a database of its own: a
//! fresh SQLite file, PostgreSQL schema or MariaDB database.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::isolated::{Isolated, isolated};
use common::{effects, insert_effect, unique};
use idem::outbox::{Backoff, FnSink, Message, OutboxMessage, SinkError};
use idem::sea_orm::{Outbox, Relay, dead_messages, outbox_health, purge_published, retry_dead};
use idem::{ErrorKind, idempotent};
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement, TransactionTrait};
use serde::{Deserialize, Serialize};

/// A boxed delivery, for sinks whose future is an `async` block.
type SinkFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), SinkError>> + Send>>;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Place {
    key: String,
    run: String,
    aggregate: String,
    fail: bool,
}

#[derive(Debug)]
enum TestError {
    #[allow(dead_code)] // shown by Debug when a test fails
    Idem(idem::Error),
    Flaky,
}

impl From<idem::Error> for TestError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

#[idempotent(scope = "outbox.place", key = cmd.key)]
async fn place(db: &DatabaseConnection, cmd: Place) -> Result<Vec<String>, TestError> {
    insert_effect(db, &cmd.run, "order", 1).await;
    let placed = db
        .stage(Message::json(format!("t.{}", cmd.run), &cmd)?.aggregate(cmd.aggregate.clone()))
        .await?;
    let audited = db
        .stage(Message::new(format!("t.{}", cmd.run), b"audit".to_vec()).header("kind", "audit"))
        .await?;
    if cmd.fail {
        return Err(TestError::Flaky);
    }
    Ok(vec![placed, audited])
}

async fn count(db: &DatabaseConnection, sql: &str) -> i64 {
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .expect("count")
        .expect("row")
        .try_get_by_index::<i64>(0)
        .expect("integer")
}

/// A sink that remembers every delivery (id, aggregate, sequence) in arrival order.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<OutboxMessage>>>,
}

impl Recorder {
    fn sink(
        &self,
    ) -> FnSink<impl Fn(OutboxMessage) -> std::future::Ready<Result<(), SinkError>> + use<>> {
        let seen = self.seen.clone();
        FnSink::new(move |m: OutboxMessage| {
            seen.lock().expect("lock").push(m);
            std::future::ready(Ok(()))
        })
    }

    /// Like [`Recorder::sink`], each delivery taking `delay`: a relay busy publishing leaves
    /// the next messages to the other relays, as a real broker's round trip does.
    fn slow_sink(&self, delay: Duration) -> FnSink<impl Fn(OutboxMessage) -> SinkFuture + use<>> {
        let seen = self.seen.clone();
        FnSink::new(move |m: OutboxMessage| {
            let seen = seen.clone();
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                seen.lock().expect("lock").push(m);
                Ok(())
            }) as SinkFuture
        })
    }

    fn deliveries(&self) -> Vec<OutboxMessage> {
        self.seen.lock().expect("lock").clone()
    }

    fn per_id(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for m in self.deliveries() {
            *counts.entry(m.id).or_default() += 1;
        }
        counts
    }
}

async fn drain<S: idem::outbox::Sink>(relay: &Relay<S>) {
    for _ in 0..1000 {
        if relay.run_once().await.expect("relay round").claimed == 0 {
            return;
        }
    }
    panic!("the relay never ran dry");
}

#[tokio::test]
async fn staged_messages_commit_with_the_handler_and_a_replay_stages_nothing() {
    for Isolated { name, db, .. } in isolated().await {
        let run = unique("stage");
        let cmd = Place {
            key: format!("{run}-k"),
            run: run.clone(),
            aggregate: "order-1".into(),
            fail: false,
        };
        let first = place(&db, cmd.clone()).await.expect("first");
        let again = place(&db, cmd).await.expect("replay");
        assert_eq!(
            first, again,
            "{name}: the replay answers with the same message ids"
        );
        assert_eq!(
            count(&db, "SELECT COUNT(*) FROM idem_outbox").await,
            2,
            "{name}: two messages, staged once"
        );
        assert_eq!(effects(&db, &run).await, 1, "{name}");

        let failed = place(
            &db,
            Place {
                key: format!("{run}-f"),
                run: format!("{run}-f"),
                aggregate: "order-2".into(),
                fail: true,
            },
        )
        .await;
        assert!(matches!(failed, Err(TestError::Flaky)), "{name}");
        assert_eq!(
            count(&db, "SELECT COUNT(*) FROM idem_outbox").await,
            2,
            "{name}: a rolled-back call stages nothing"
        );
        assert_eq!(
            count(&db, "SELECT COUNT(*) FROM idem_outbox_heads").await,
            1,
            "{name}: the rolled-back aggregate head is gone too"
        );

        let recorder = Recorder::default();
        let relay = Relay::new(db.clone(), recorder.sink());
        drain(&relay).await;
        let seen = recorder.deliveries();
        assert_eq!(seen.len(), 2, "{name}");
        assert!(seen.iter().all(|m| first.contains(&m.id)), "{name}");
        let audit = seen.iter().find(|m| m.aggregate.is_none()).expect("audit");
        assert_eq!(audit.headers, vec![("kind".to_owned(), "audit".to_owned())]);
        assert_eq!(audit.payload, b"audit");
        let placed = seen.iter().find(|m| m.aggregate.is_some()).expect("placed");
        assert_eq!(placed.aggregate_seq, Some(1), "{name}");
        assert_eq!(placed.attempt, 1, "{name}");
        let health = outbox_health(&db).await.expect("health");
        assert_eq!((health.pending, health.dead), (0, 0), "{name}");
        assert_eq!(health.oldest_pending_ms, None, "{name}");
        assert_eq!(relay.counters().published, 2, "{name}");
    }
}

#[tokio::test]
async fn invalid_messages_are_refused_before_anything_is_written() {
    for Isolated { name, db, .. } in isolated().await {
        for message in [
            Message::new("", b"x".to_vec()),
            Message::new("t", b"x".to_vec()).aggregate("a".repeat(256)),
            Message::new("t", b"x".to_vec()).header("bad header", "v"),
        ] {
            let e = db.stage(message).await.expect_err("refused");
            assert_eq!(e.kind(), ErrorKind::InvalidMessage, "{name}: {e}");
        }
        assert_eq!(count(&db, "SELECT COUNT(*) FROM idem_outbox").await, 0);
    }
}

/// Stages `per_aggregate` messages on each of `aggregates` aggregates from concurrent
/// transactions that hold their writes a random while, so commits interleave.
async fn stage_interleaved(db: &DatabaseConnection, aggregates: usize, per_aggregate: usize) {
    let mut tasks = Vec::new();
    for a in 0..aggregates {
        for m in 0..per_aggregate {
            let db = db.clone();
            tasks.push(tokio::spawn(async move {
                let delay = Duration::from_millis(((a * 7 + m * 13) % 11) as u64);
                let tx = db.begin().await.expect("begin");
                tx.stage(
                    Message::new("t.order", format!("{a}:{m}").into_bytes())
                        .aggregate(format!("agg-{a}")),
                )
                .await
                .expect("stage");
                tokio::time::sleep(delay).await;
                tx.commit().await.expect("commit");
            }));
        }
    }
    for t in tasks {
        t.await.expect("stager");
    }
}

#[tokio::test]
async fn each_aggregate_reaches_the_sink_in_commit_order_across_four_relays() {
    for Isolated { name, db, .. } in isolated().await {
        let (aggregates, per_aggregate) = (8, 8);
        stage_interleaved(&db, aggregates, per_aggregate).await;
        let recorder = Recorder::default();
        let relays: Vec<_> = (0..4)
            .map(|_| {
                Arc::new(
                    Relay::new(db.clone(), recorder.slow_sink(Duration::from_millis(2)))
                        .batch_size(5)
                        .poll_interval(Duration::from_millis(20)),
                )
            })
            .collect();
        let started = Instant::now();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let running: Vec<_> = relays
            .iter()
            .map(|relay| {
                let relay = relay.clone();
                let mut stopped = stopped.clone();
                tokio::spawn(async move {
                    relay
                        .run(async move {
                            let _ = stopped.wait_for(|s| *s).await;
                        })
                        .await
                })
            })
            .collect();
        while recorder.deliveries().len() < aggregates * per_aggregate {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{name}: only {} delivered",
                recorder.deliveries().len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.send(true).expect("stop");
        for r in running {
            r.await.expect("relay task").expect("relay");
        }
        let mut per_aggregate_seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for m in recorder.deliveries() {
            per_aggregate_seen
                .entry(m.aggregate.clone().expect("aggregate"))
                .or_default()
                .push(m.aggregate_seq.expect("seq"));
        }
        assert_eq!(per_aggregate_seen.len(), aggregates, "{name}");
        for (aggregate, seqs) in &per_aggregate_seen {
            let expected: Vec<i64> = (1..=per_aggregate as i64).collect();
            assert_eq!(seqs, &expected, "{name}: {aggregate} out of order");
        }
        assert!(
            recorder.per_id().values().all(|&n| n == 1),
            "{name}: no message twice without a failure"
        );
        let worked = relays.iter().filter(|r| r.counters().published > 0).count();
        assert!(worked >= 2, "{name}: only {worked} relay(s) did any work");
    }
}

#[tokio::test]
async fn a_poison_message_goes_dead_and_blocks_only_its_own_aggregate() {
    for Isolated { name, db, .. } in isolated().await {
        let tx = db.begin().await.expect("begin");
        let poison = tx
            .stage(Message::new("t.p", b"poison".to_vec()).aggregate("sick"))
            .await
            .expect("stage");
        tx.stage(Message::new("t.p", b"after".to_vec()).aggregate("sick"))
            .await
            .expect("stage");
        for i in 0..3 {
            tx.stage(Message::new("t.p", vec![i]).aggregate("healthy"))
                .await
                .expect("stage");
        }
        tx.commit().await.expect("commit");

        let refuse = Arc::new(Mutex::new(Some(poison.clone())));
        let delivered = Recorder::default();
        let sink = {
            let refuse = refuse.clone();
            let seen = delivered.seen.clone();
            FnSink::new(move |m: OutboxMessage| {
                let refused = refuse.lock().expect("lock").as_deref() == Some(m.id.as_str());
                if !refused {
                    seen.lock().expect("lock").push(m);
                }
                async move {
                    if refused {
                        Err(SinkError::transient("the receiver is down for this one"))
                    } else {
                        Ok(())
                    }
                }
            })
        };
        let relay = Relay::new(db.clone(), sink)
            .max_attempts(3)
            .backoff(Backoff {
                initial: Duration::from_millis(1),
                max: Duration::from_millis(2),
            });
        let started = Instant::now();
        while outbox_health(&db).await.expect("health").dead == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{name}: never dead"
            );
            relay.run_once().await.expect("round");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drain(&relay).await;
        let healthy: Vec<_> = delivered
            .deliveries()
            .iter()
            .filter(|m| m.aggregate.as_deref() == Some("healthy"))
            .map(|m| m.aggregate_seq)
            .collect();
        assert_eq!(healthy, vec![Some(1), Some(2), Some(3)], "{name}");
        assert!(
            delivered
                .deliveries()
                .iter()
                .all(|m| m.aggregate.as_deref() != Some("sick")),
            "{name}: the message after the dead one waits"
        );
        let dead = dead_messages(&db, 10).await.expect("dead");
        assert_eq!(dead.len(), 1, "{name}");
        assert_eq!(dead[0].id, poison);
        assert_eq!(dead[0].attempts, 3, "{name}");
        assert!(
            dead[0]
                .last_error
                .as_deref()
                .unwrap_or_default()
                .contains("down"),
            "{name}: {:?}",
            dead[0].last_error
        );
        let health = outbox_health(&db).await.expect("health");
        assert_eq!((health.pending, health.dead), (1, 1), "{name}");
        assert_eq!(relay.counters().dead, 1, "{name}");

        // The operator fixes the receiver and retries: the aggregate flows again, in order.
        *refuse.lock().expect("lock") = None;
        assert!(retry_dead(&db, &poison).await.expect("retry"), "{name}");
        assert!(
            !retry_dead(&db, "no-such-id").await.expect("retry"),
            "{name}"
        );
        drain(&relay).await;
        let sick: Vec<_> = delivered
            .deliveries()
            .iter()
            .filter(|m| m.aggregate.as_deref() == Some("sick"))
            .map(|m| (m.aggregate_seq, m.payload.clone()))
            .collect();
        assert_eq!(
            sick,
            vec![(Some(1), b"poison".to_vec()), (Some(2), b"after".to_vec())],
            "{name}"
        );
        assert_eq!(outbox_health(&db).await.expect("health").dead, 0, "{name}");
    }
}

#[tokio::test]
async fn a_permanent_refusal_is_dead_at_once_and_purge_keeps_recent_messages() {
    for Isolated { name, db, .. } in isolated().await {
        db.stage(Message::new("t.refused", b"no".to_vec()))
            .await
            .expect("stage");
        let relay = Relay::new(
            db.clone(),
            FnSink::new(|_m: OutboxMessage| async {
                Err(SinkError::permanent("422 from the API"))
            }),
        );
        let round = relay.run_once().await.expect("round");
        assert_eq!((round.claimed, round.dead), (1, 1), "{name}");
        assert_eq!(dead_messages(&db, 10).await.expect("dead")[0].attempts, 1);

        for i in 0..5u8 {
            db.stage(Message::new("t.ok", vec![i]))
                .await
                .expect("stage");
        }
        let recorder = Recorder::default();
        drain(&Relay::new(db.clone(), recorder.sink())).await;
        assert_eq!(recorder.deliveries().len(), 5, "{name}");
        let published = "SELECT COUNT(*) FROM idem_outbox WHERE state = 1";
        assert_eq!(count(&db, published).await, 5, "{name}");
        assert_eq!(
            purge_published(&db, Duration::from_secs(3600), 2)
                .await
                .expect("purge"),
            0,
            "{name}: nothing is old enough"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            purge_published(&db, Duration::from_millis(1), 2)
                .await
                .expect("purge"),
            5,
            "{name}: in batches of 2"
        );
        assert_eq!(count(&db, published).await, 0, "{name}");
        assert_eq!(
            count(&db, "SELECT COUNT(*) FROM idem_outbox").await,
            1,
            "{name}: the dead message stays"
        );
    }
}

#[tokio::test]
async fn a_committed_call_wakes_the_relay_before_its_poll_interval() {
    for Isolated { name, db, .. } in isolated().await {
        let recorder = Recorder::default();
        let relay = Arc::new(
            Relay::new(db.clone(), recorder.sink()).poll_interval(Duration::from_secs(3600)),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = {
            let relay = relay.clone();
            tokio::spawn(async move { relay.run(stopped).await })
        };
        // Let the relay find the table empty and go to sleep.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let run = unique("wake");
        let started = Instant::now();
        place(
            &db,
            Place {
                key: format!("{run}-k"),
                run,
                aggregate: "o".into(),
                fail: false,
            },
        )
        .await
        .expect("place");
        while recorder.deliveries().len() < 2 {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{name}: the relay slept through the commit"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let latency = started.elapsed();
        stop.send(()).expect("stop");
        running.await.expect("task").expect("relay");
        println!("{name}: commit-to-publish {latency:?} with a one-hour poll interval");
        assert!(latency < Duration::from_secs(5), "{name}: {latency:?}");
    }
}

#[tokio::test]
async fn a_message_whose_lease_lapsed_is_claimed_again_and_the_stale_mark_is_ignored() {
    for Isolated { name, db, .. } in isolated().await {
        db.stage(Message::new("t.lease", b"x".to_vec()))
            .await
            .expect("stage");
        // A sink slower than the lease: the first relay's attempt times out and is retried.
        let calls = Arc::new(Mutex::new(0));
        let sink = {
            let calls = calls.clone();
            FnSink::new(move |_m: OutboxMessage| {
                let n = {
                    let mut calls = calls.lock().expect("lock");
                    *calls += 1;
                    *calls
                };
                async move {
                    if n == 1 {
                        tokio::time::sleep(Duration::from_millis(400)).await;
                    }
                    Ok(())
                }
            })
        };
        let relay = Relay::new(db.clone(), sink)
            .lease(Duration::from_millis(100))
            .backoff(Backoff {
                initial: Duration::from_millis(1),
                max: Duration::from_millis(1),
            });
        let first = relay.run_once().await.expect("round");
        assert_eq!((first.claimed, first.retrying), (1, 1), "{name}: timed out");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let second = relay.run_once().await.expect("round");
        assert_eq!((second.claimed, second.published), (1, 1), "{name}");
        assert_eq!(*calls.lock().expect("lock"), 2, "{name}");
        let twice = count(&db, "SELECT COUNT(*) FROM idem_outbox WHERE attempts = 2").await;
        assert_eq!(twice, 1, "{name}: two attempts recorded");
    }
}
