//! The outbox on every backend of the run, through both stores (SeaORM's and sqlx's: the
//! handler written once per connection type, `handlers!`; the relay through [`AnyRelay`]):
//! staging commits with the handler's writes (and a replay stages nothing), the relay
//! delivers each message once per success and keeps each aggregate in commit order across
//! relays, poison messages go dead without blocking other aggregates, and a committed message
//! wakes the relay. Every test counts rows or deliveries, read through SeaORM whichever store
//! staged and relayed; dead messages, retries and purges are the SeaORM store's operator
//! functions on the same tables.
//!
//! A relay claims every message of its table, so each case gets a database of its own: a
//! fresh SQLite file, PostgreSQL schema or MariaDB database.

mod common;

use common::stores::Conn;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::isolated::{Isolated, isolated};
use common::{effects, insert_effect, unique};
use idem::outbox::{Backoff, FnSink, Message, OutboxHealth, OutboxMessage, Sink, SinkError};
use idem::sea_orm::{DeadMessage, RelayCounters, RelayRound};
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

/// The handler, once per kind of connection: `$conn` is what it takes (SeaORM's connection
/// or a sqlx pool), `insert` writes the order's effect row through the body's connection
/// `$db`.
macro_rules! handlers {
    ($module:ident, $conn:ty, insert = |$db:ident, $run:ident| $insert:expr $(,)?) => {
        mod $module {
            use super::*;
            #[allow(unused_imports)]
            use idem::sea_orm::Outbox as _;
            #[allow(unused_imports)]
            use idem::sqlx::Outbox as _;
            #[allow(unused_imports)]
            use idem::tokio_postgres::Outbox as _;

            #[idempotent(scope = "outbox.place", key = cmd.key)]
            pub(crate) async fn place(db: &$conn, cmd: Place) -> Result<Vec<String>, TestError> {
                // The body's connection goes through the insert and comes back.
                let db = {
                    let ($db, $run) = (db, &cmd.run);
                    $insert;
                    $db
                };
                let placed = db
                    .stage(
                        Message::json(format!("t.{}", cmd.run), &cmd)?
                            .aggregate(cmd.aggregate.clone()),
                    )
                    .await?;
                let audited = db
                    .stage(
                        Message::new(format!("t.{}", cmd.run), b"audit".to_vec())
                            .header("kind", "audit"),
                    )
                    .await?;
                if cmd.fail {
                    return Err(TestError::Flaky);
                }
                Ok(vec![placed, audited])
            }
        }
    };
}

handlers!(
    on_sea_orm,
    DatabaseConnection,
    insert = |db, run| insert_effect(db, run, "order", 1).await,
);

/// The sqlx handler's insert, in `$p`'s placeholders.
macro_rules! sqlx_handlers {
    ($module:ident, $pool:ty, $p1:literal, $p2:literal, $p3:literal) => {
        handlers!(
            $module,
            $pool,
            insert = |db, run| sqlx::query(concat!(
                "INSERT INTO idem_test_effects (run_id, label, amount) VALUES (",
                $p1,
                ", ",
                $p2,
                ", ",
                $p3,
                ")"
            ))
            .bind(run)
            .bind("order")
            .bind(1_i64)
            .execute(&mut *db)
            .await
            .expect("insert effect"),
        );
    };
}

sqlx_handlers!(on_sqlx_sqlite, sqlx::SqlitePool, "?", "?", "?");
sqlx_handlers!(on_sqlx_postgres, sqlx::PgPool, "$1", "$2", "$3");
sqlx_handlers!(on_sqlx_mysql, sqlx::MySqlPool, "?", "?", "?");

handlers!(
    on_tokio_postgres,
    idem::tokio_postgres::deadpool_postgres::Pool,
    insert = |db, run| db
        .execute(
            "INSERT INTO idem_test_effects (run_id, label, amount) VALUES ($1, $2, $3)",
            &[run, &"order", &1_i64],
        )
        .await
        .expect("insert effect"),
);

/// One test on one backend and one store, in a database of its own. `db` is the database's
/// SeaORM connection, which the test reads through whichever store stages and relays.
#[derive(Clone)]
struct Case {
    name: String,
    db: DatabaseConnection,
    conn: Conn,
}

/// A case per backend of the run and per store, each in a database of its own.
async fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for Isolated { name, db, .. } in isolated().await {
        cases.push(Case {
            name: name.to_owned(),
            db,
            conn: Conn::SeaOrm,
        });
    }
    for Isolated { name, db, url } in isolated().await {
        if name == "postgres" {
            cases.push(Case {
                name: format!("{name} (tokio-postgres)"),
                db,
                conn: Conn::tokio_postgres(&url),
            });
        }
    }
    for Isolated { name, db, url } in isolated().await {
        let conn = Conn::sqlx(name, &url).await;
        cases.push(Case {
            name: format!("{name} (sqlx)"),
            db,
            conn,
        });
    }
    cases
}

/// Runs `$sqlx` with `$pool` bound to the sqlx pool of the case, `$sea_orm` for SeaORM's, or
/// `$tokio_postgres` with `$pool` bound to the deadpool pool.
macro_rules! on_store {
    (
        $case:expr,
        sea_orm => $sea_orm:expr,
        |$pool:ident| $sqlx:expr,
        tokio_postgres => $tokio_postgres:expr $(,)?
    ) => {
        match &$case.conn {
            Conn::SeaOrm => $sea_orm,
            Conn::SqlxSqlite($pool) => $sqlx,
            Conn::SqlxPostgres($pool) => $sqlx,
            Conn::SqlxMySql($pool) => $sqlx,
            Conn::TokioPostgres($pool) => $tokio_postgres,
        }
    };
}

impl Case {
    /// Places an order through the case's store.
    async fn place(&self, cmd: Place) -> Result<Vec<String>, TestError> {
        match &self.conn {
            Conn::SeaOrm => on_sea_orm::place(&self.db, cmd).await,
            Conn::SqlxSqlite(pool) => on_sqlx_sqlite::place(pool, cmd).await,
            Conn::SqlxPostgres(pool) => on_sqlx_postgres::place(pool, cmd).await,
            Conn::SqlxMySql(pool) => on_sqlx_mysql::place(pool, cmd).await,
            Conn::TokioPostgres(pool) => on_tokio_postgres::place(pool, cmd).await,
        }
    }

    /// Stages `message` outside any transaction of ours (the statement commits alone).
    async fn stage(&self, message: Message) -> Result<String, idem::Error> {
        use idem::sea_orm::Outbox as _;
        use idem::sqlx::Outbox as _;
        use idem::tokio_postgres::Outbox as _;
        on_store!(self, sea_orm => self.db.stage(message).await, |pool| {
            pool.acquire().await.expect("connection").stage(message).await
        }, tokio_postgres => pool.get().await.expect("connection").stage(message).await)
    }

    /// Stages `messages` in one transaction held open `hold` before it commits; their ids.
    async fn stage_together(&self, messages: Vec<Message>, hold: Duration) -> Vec<String> {
        use idem::sea_orm::Outbox as _;
        use idem::sqlx::Outbox as _;
        use idem::tokio_postgres::Outbox as _;
        let mut ids = Vec::new();
        on_store!(self, sea_orm => {
            let tx = self.db.begin().await.expect("begin");
            for message in messages {
                ids.push(tx.stage(message).await.expect("stage"));
            }
            tokio::time::sleep(hold).await;
            tx.commit().await.expect("commit");
        }, |pool| {
            let mut tx = pool.begin().await.expect("begin");
            for message in messages {
                ids.push(tx.stage(message).await.expect("stage"));
            }
            tokio::time::sleep(hold).await;
            tx.commit().await.expect("commit");
        }, tokio_postgres => {
            let mut client = pool.get().await.expect("connection");
            let tx = client.transaction().await.expect("begin");
            for message in messages {
                ids.push(tx.stage(message).await.expect("stage"));
            }
            tokio::time::sleep(hold).await;
            tx.commit().await.expect("commit");
        });
        ids
    }

    /// The case's store's relay to `sink`.
    fn relay<S: Sink>(&self, sink: S) -> AnyRelay<S> {
        match &self.conn {
            Conn::SeaOrm => AnyRelay::SeaOrm(idem::sea_orm::Relay::new(self.db.clone(), sink)),
            Conn::SqlxSqlite(pool) => {
                AnyRelay::SqlxSqlite(idem::sqlx::Relay::new(pool.clone(), sink))
            }
            Conn::SqlxPostgres(pool) => {
                AnyRelay::SqlxPostgres(idem::sqlx::Relay::new(pool.clone(), sink))
            }
            Conn::SqlxMySql(pool) => {
                AnyRelay::SqlxMySql(idem::sqlx::Relay::new(pool.clone(), sink))
            }
            Conn::TokioPostgres(pool) => {
                AnyRelay::TokioPostgres(idem::tokio_postgres::Relay::new(pool, sink))
            }
        }
    }

    /// Up to 10 dead messages, read by the case's store.
    async fn dead_messages(&self) -> Vec<DeadMessage> {
        on_store!(self, sea_orm => idem::sea_orm::dead_messages(&self.db, 10).await, |pool| {
            idem::sqlx::dead_messages(pool, 10).await
        }, tokio_postgres => idem::tokio_postgres::dead_messages(pool, 10).await)
        .expect("dead messages")
    }

    /// Puts the dead message `id` back in line through the case's store.
    async fn retry_dead(&self, id: &str) -> bool {
        on_store!(self, sea_orm => idem::sea_orm::retry_dead(&self.db, id).await, |pool| {
            idem::sqlx::retry_dead(pool, id).await
        }, tokio_postgres => idem::tokio_postgres::retry_dead(pool, id).await)
        .expect("retry")
    }

    /// Purges messages published before `retention`, 2 per statement, through the case's
    /// store.
    async fn purge_published(&self, retention: Duration) -> u64 {
        on_store!(self, sea_orm => idem::sea_orm::purge_published(&self.db, retention, 2).await, |pool| {
            idem::sqlx::purge_published(pool, retention, 2).await
        }, tokio_postgres => idem::tokio_postgres::purge_published(pool, retention, 2).await)
        .expect("purge")
    }

    /// The outbox's figures, read by the case's store.
    async fn health(&self) -> OutboxHealth {
        on_store!(self, sea_orm => idem::sea_orm::outbox_health(&self.db).await, |pool| {
            idem::sqlx::outbox_health(pool).await
        }, tokio_postgres => idem::tokio_postgres::outbox_health(pool).await)
        .expect("health")
    }
}

/// The relay of either store, as the tests drive it.
enum AnyRelay<S> {
    SeaOrm(idem::sea_orm::Relay<S>),
    SqlxSqlite(idem::sqlx::Relay<sqlx::Sqlite, S>),
    SqlxPostgres(idem::sqlx::Relay<sqlx::Postgres, S>),
    SqlxMySql(idem::sqlx::Relay<sqlx::MySql, S>),
    TokioPostgres(idem::tokio_postgres::Relay<S>),
}

/// `$e` with `$r` bound to whichever relay `$relay` holds; `wrap` puts a relay it returns
/// back in the same variant.
macro_rules! each_relay {
    ($relay:expr, |$r:ident| $e:expr) => {
        match $relay {
            AnyRelay::SeaOrm($r) => $e,
            AnyRelay::SqlxSqlite($r) => $e,
            AnyRelay::SqlxPostgres($r) => $e,
            AnyRelay::SqlxMySql($r) => $e,
            AnyRelay::TokioPostgres($r) => $e,
        }
    };
    ($relay:expr, wrap |$r:ident| $e:expr) => {
        match $relay {
            AnyRelay::SeaOrm($r) => AnyRelay::SeaOrm($e),
            AnyRelay::SqlxSqlite($r) => AnyRelay::SqlxSqlite($e),
            AnyRelay::SqlxPostgres($r) => AnyRelay::SqlxPostgres($e),
            AnyRelay::SqlxMySql($r) => AnyRelay::SqlxMySql($e),
            AnyRelay::TokioPostgres($r) => AnyRelay::TokioPostgres($e),
        }
    };
}

impl<S: Sink> AnyRelay<S> {
    fn batch_size(self, batch_size: u32) -> Self {
        each_relay!(self, wrap | r | r.batch_size(batch_size))
    }

    fn lease(self, lease: Duration) -> Self {
        each_relay!(self, wrap | r | r.lease(lease))
    }

    fn max_attempts(self, max_attempts: u32) -> Self {
        each_relay!(self, wrap | r | r.max_attempts(max_attempts))
    }

    fn backoff(self, backoff: Backoff) -> Self {
        each_relay!(self, wrap | r | r.backoff(backoff))
    }

    fn poll_interval(self, poll_interval: Duration) -> Self {
        each_relay!(self, wrap | r | r.poll_interval(poll_interval))
    }

    async fn run_once(&self) -> Result<RelayRound, idem::Error> {
        each_relay!(self, |r| r.run_once().await)
    }

    async fn run(&self, shutdown: impl Future) -> Result<(), idem::Error> {
        each_relay!(self, |r| r.run(shutdown).await)
    }

    fn counters(&self) -> RelayCounters {
        each_relay!(self, |r| r.counters())
    }
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

async fn drain<S: Sink>(relay: &AnyRelay<S>) {
    for _ in 0..1000 {
        if relay.run_once().await.expect("relay round").claimed == 0 {
            return;
        }
    }
    panic!("the relay never ran dry");
}

#[tokio::test]
async fn staged_messages_commit_with_the_handler_and_a_replay_stages_nothing() {
    for case in cases().await {
        let (name, db) = (case.name.clone(), case.db.clone());
        let run = unique("stage");
        let cmd = Place {
            key: format!("{run}-k"),
            run: run.clone(),
            aggregate: "order-1".into(),
            fail: false,
        };
        let first = case.place(cmd.clone()).await.expect("first");
        let again = case.place(cmd).await.expect("replay");
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

        let failed = case
            .place(Place {
                key: format!("{run}-f"),
                run: format!("{run}-f"),
                aggregate: "order-2".into(),
                fail: true,
            })
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
        let relay = case.relay(recorder.sink());
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
        let health = case.health().await;
        assert_eq!((health.pending, health.dead), (0, 0), "{name}");
        assert_eq!(health.oldest_pending_ms, None, "{name}");
        assert_eq!(relay.counters().published, 2, "{name}");
    }
}

#[tokio::test]
async fn invalid_messages_are_refused_before_anything_is_written() {
    for case in cases().await {
        let (name, db) = (case.name.clone(), case.db.clone());
        for message in [
            Message::new("", b"x".to_vec()),
            Message::new("t", b"x".to_vec()).aggregate("a".repeat(256)),
            Message::new("t", b"x".to_vec()).header("bad header", "v"),
        ] {
            let e = case.stage(message).await.expect_err("refused");
            assert_eq!(e.kind(), ErrorKind::InvalidMessage, "{name}: {e}");
        }
        assert_eq!(count(&db, "SELECT COUNT(*) FROM idem_outbox").await, 0);
    }
}

/// Stages `per_aggregate` messages on each of `aggregates` aggregates from concurrent
/// transactions that hold their writes a random while, so commits interleave.
async fn stage_interleaved(case: &Case, aggregates: usize, per_aggregate: usize) {
    let mut tasks = Vec::new();
    for a in 0..aggregates {
        for m in 0..per_aggregate {
            let case = case.clone();
            tasks.push(tokio::spawn(async move {
                let delay = Duration::from_millis(((a * 7 + m * 13) % 11) as u64);
                let message = Message::new("t.order", format!("{a}:{m}").into_bytes())
                    .aggregate(format!("agg-{a}"));
                case.stage_together(vec![message], delay).await;
            }));
        }
    }
    for t in tasks {
        t.await.expect("stager");
    }
}

#[tokio::test]
async fn each_aggregate_reaches_the_sink_in_commit_order_across_four_relays() {
    for case in cases().await {
        let name = case.name.clone();
        let (aggregates, per_aggregate) = (8, 8);
        stage_interleaved(&case, aggregates, per_aggregate).await;
        let recorder = Recorder::default();
        let relays: Vec<_> = (0..4)
            .map(|_| {
                Arc::new(
                    case.relay(recorder.slow_sink(Duration::from_millis(2)))
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
    for case in cases().await {
        let name = case.name.clone();
        let mut messages = vec![
            Message::new("t.p", b"poison".to_vec()).aggregate("sick"),
            Message::new("t.p", b"after".to_vec()).aggregate("sick"),
        ];
        messages.extend((0..3).map(|i| Message::new("t.p", vec![i]).aggregate("healthy")));
        let poison = case.stage_together(messages, Duration::ZERO).await[0].clone();

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
        let relay = case.relay(sink).max_attempts(3).backoff(Backoff {
            initial: Duration::from_millis(1),
            max: Duration::from_millis(2),
        });
        let started = Instant::now();
        while case.health().await.dead == 0 {
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
        let dead = case.dead_messages().await;
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
        let health = case.health().await;
        assert_eq!((health.pending, health.dead), (1, 1), "{name}");
        assert_eq!(relay.counters().dead, 1, "{name}");

        // The operator fixes the receiver and retries: the aggregate flows again, in order.
        *refuse.lock().expect("lock") = None;
        assert!(case.retry_dead(&poison).await, "{name}");
        assert!(!case.retry_dead("no-such-id").await, "{name}");
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
        assert_eq!(case.health().await.dead, 0, "{name}");
    }
}

#[tokio::test]
async fn a_permanent_refusal_is_dead_at_once_and_purge_keeps_recent_messages() {
    for case in cases().await {
        let (name, db) = (case.name.clone(), case.db.clone());
        case.stage(Message::new("t.refused", b"no".to_vec()))
            .await
            .expect("stage");
        let relay = case.relay(FnSink::new(|_m: OutboxMessage| async {
            Err(SinkError::permanent("422 from the API"))
        }));
        let round = relay.run_once().await.expect("round");
        assert_eq!((round.claimed, round.dead), (1, 1), "{name}");
        assert_eq!(case.dead_messages().await[0].attempts, 1, "{name}");

        for i in 0..5u8 {
            case.stage(Message::new("t.ok", vec![i]))
                .await
                .expect("stage");
        }
        let recorder = Recorder::default();
        drain(&case.relay(recorder.sink())).await;
        assert_eq!(recorder.deliveries().len(), 5, "{name}");
        let published = "SELECT COUNT(*) FROM idem_outbox WHERE state = 1";
        assert_eq!(count(&db, published).await, 5, "{name}");
        assert_eq!(
            case.purge_published(Duration::from_secs(3600)).await,
            0,
            "{name}: nothing is old enough"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            case.purge_published(Duration::from_millis(1)).await,
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

/// `outbox_health`'s dead count (and `dead_messages`) read dead messages through an index on
/// SQLite: its planner cannot use the aggregate index's `state <> published` for `state =
/// dead`, and it scanned every message the retention keeps (16 ms at 200,000 messages).
#[tokio::test]
async fn the_dead_count_reads_an_index_not_the_whole_outbox_on_sqlite() {
    for case in cases().await {
        if case.db.get_database_backend() != sea_orm::DbBackend::Sqlite {
            continue;
        }
        // The health statement's dead count, as `idem_sql::Outbox::outbox_health` renders it.
        let plan = case
            .db
            .query_all_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::Sqlite,
                "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM idem_outbox WHERE state = 2",
            ))
            .await
            .expect("the plan");
        let steps: Vec<String> = plan
            .iter()
            .map(|row| row.try_get_by_index::<String>(3).expect("a plan step"))
            .collect();
        assert!(
            steps
                .iter()
                .any(|step| step.contains("INDEX idem_outbox_dead")),
            "{}: the dead count scans the outbox: {steps:?}",
            case.name
        );
    }
}

#[tokio::test]
async fn a_committed_call_wakes_the_relay_before_its_poll_interval() {
    for case in cases().await {
        let name = case.name.clone();
        let recorder = Recorder::default();
        let relay = Arc::new(
            case.relay(recorder.sink())
                .poll_interval(Duration::from_secs(3600)),
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
        case.place(Place {
            key: format!("{run}-k"),
            run,
            aggregate: "o".into(),
            fail: false,
        })
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
    for case in cases().await {
        let (name, db) = (case.name.clone(), case.db.clone());
        case.stage(Message::new("t.lease", b"x".to_vec()))
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
        let relay = case
            .relay(sink)
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
