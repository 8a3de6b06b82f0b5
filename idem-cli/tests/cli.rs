//! The `idem` binary run as an operator runs it, against databases a service wrote through
//! the library: SQLite always (a temp file), PostgreSQL and MariaDB when
//! `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_MYSQL_URL` are set (a set but unreachable server
//! fails the test). Each test works in a database of its own: a fresh SQLite file, a
//! PostgreSQL schema, a MariaDB database. Output content and exit codes are checked: 0 ok,
//! 1 not found, 2 error on one line.

use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::completer::{GaveUp, Resumed};
use idem::outbox::{FnSink, Message, OutboxMessage, SinkError};
use idem::sea_orm::{Completer, Outbox, Relay, SeaOrmLeaseStore};
use idem::{FinalError, idempotent};
use sea_orm::{ConnectOptions, ConnectionTrait, Database, DatabaseConnection};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Notify;

/// A database of one test's own, on one backend.
struct Isolated {
    backend: &'static str,
    /// How the tool reaches it (only it).
    url: String,
    db: DatabaseConnection,
    /// How to drop it at the end: a server's statement, or SQLite's file.
    cleanup: Cleanup,
}

enum Cleanup {
    Server(DatabaseConnection, String),
    File(std::path::PathBuf),
}

impl Isolated {
    /// Runs `idem --url <this database> args…`.
    fn idem(&self, args: &[&str]) -> Run {
        run_idem(&[&["--url", &self.url], args].concat(), self.backend)
    }

    async fn drop_database(self) {
        let _ = self.db.close().await;
        match self.cleanup {
            Cleanup::Server(admin, statement) => {
                let _ = admin.execute_unprepared(&statement).await;
            }
            Cleanup::File(path) => {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// What one run of the binary printed, and its exit code.
struct Run {
    what: String,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    #[track_caller]
    fn exits(&self, code: i32) -> &Self {
        assert_eq!(
            self.code,
            Some(code),
            "{}: exit code\nstdout:\n{}\nstderr:\n{}",
            self.what,
            self.stdout,
            self.stderr
        );
        self
    }

    #[track_caller]
    fn prints(&self, text: &str) -> &Self {
        assert!(
            self.stdout.contains(text),
            "{}: stdout lacks {text:?}:\n{}",
            self.what,
            self.stdout
        );
        self
    }

    /// The one line of an error, which must contain `text`.
    #[track_caller]
    fn fails_on_one_line(&self, text: &str) -> &Self {
        self.exits(2);
        assert_eq!(
            self.stderr.lines().count(),
            1,
            "{}: one line:\n{}",
            self.what,
            self.stderr
        );
        assert!(
            self.stderr.starts_with("error: ") && self.stderr.contains(text),
            "{}: stderr lacks {text:?}:\n{}",
            self.what,
            self.stderr
        );
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
        self
    }

    #[track_caller]
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("{}: stdout is not JSON ({e}):\n{}", self.what, self.stdout))
    }
}

fn run_idem(args: &[&str], backend: &str) -> Run {
    let output: Output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idem");
    let shown: Vec<&str> = args
        .iter()
        .copied()
        .filter(|a| !a.contains("://"))
        .collect();
    Run {
        what: format!("{backend}: idem {}", shown.join(" ")),
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// A name unique to this process and call.
fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}_{}_{nanos:x}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

async fn connect(url: &str) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url.to_owned());
    options.sqlx_logging(false);
    match Database::connect(options).await {
        Ok(db) => db,
        Err(e) => panic!("cannot connect to {url} (set by the environment, so this fails): {e}"),
    }
}

/// A database of this test's own on every backend of the run, with idem's tables when
/// `with_tables`.
async fn isolated(with_tables: bool) -> Vec<Isolated> {
    let path = std::env::temp_dir().join(format!("{}.db", unique("idem-cli")));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let mut all = vec![Isolated {
        backend: "sqlite",
        db: connect(&url).await,
        url,
        cleanup: Cleanup::File(path),
    }];
    let servers = [
        ("postgres", "IDEM_TEST_POSTGRES_URL"),
        ("mysql", "IDEM_TEST_MYSQL_URL"),
    ];
    for (backend, var) in servers {
        let Ok(server) = std::env::var(var) else {
            continue;
        };
        let admin = connect(&server).await;
        let namespace = unique("cli");
        let (url, drop) = if backend == "postgres" {
            admin
                .execute_unprepared(&format!("CREATE SCHEMA {namespace}"))
                .await
                .expect("create schema");
            let separator = if server.contains('?') { '&' } else { '?' };
            (
                format!("{server}{separator}options=-c%20search_path%3D{namespace}"),
                format!("DROP SCHEMA {namespace} CASCADE"),
            )
        } else {
            admin
                .execute_unprepared(&format!("CREATE DATABASE {namespace}"))
                .await
                .expect("create database");
            let base = server.rsplit_once('/').map_or(server.as_str(), |(b, _)| b);
            (
                format!("{base}/{namespace}"),
                format!("DROP DATABASE {namespace}"),
            )
        };
        all.push(Isolated {
            backend,
            db: connect(&url).await,
            url,
            cleanup: Cleanup::Server(admin, drop),
        });
    }
    if with_tables {
        for database in &all {
            idem::sea_orm::create_tables(&database.db)
                .await
                .expect("create tables");
        }
    }
    all
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    order: String,
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize)]
enum PayError {
    /// idem's own errors are never recorded (only `Debug` reads it, in a failed `expect`).
    #[serde(skip)]
    #[allow(dead_code)]
    Idem(idem::Error),
    Declined {
        reason: String,
    },
}

impl From<idem::Error> for PayError {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl FinalError for PayError {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined { .. })
    }
}

/// A payment as a service records it: a receipt, a message staged for the relay; a negative
/// amount is a final error (recorded, replayed).
#[idempotent(scope = "shop.orders.pay", key = key)]
async fn pay(
    db: &DatabaseConnection,
    key: String,
    order: String,
    amount_cents: i64,
) -> Result<Receipt, PayError> {
    if amount_cents < 0 {
        return Err(PayError::Declined {
            reason: "card declined".to_owned(),
        });
    }
    let paid = serde_json::json!({ "order": order, "amount_cents": amount_cents });
    db.stage(Message::json("shop.orders.paid", &paid)?.aggregate(order.clone()))
        .await?;
    Ok(Receipt {
        order,
        amount_cents,
    })
}

/// A resumable lease-mode call that records its `label` step, then hangs until dropped.
#[idempotent(scope = "shop.orders.ship", key = key, lease = "1s", resumable, skip(entered))]
async fn ship(
    db: &DatabaseConnection,
    entered: &Arc<Notify>,
    key: String,
    order: String,
) -> Result<String, PayError> {
    let _ = db;
    let label: String = idem::step("label", |_| async move {
        Ok::<_, PayError>(format!("label-{order}"))
    })
    .await?;
    entered.notify_one();
    std::future::pending::<()>().await;
    Ok(label)
}

/// The same without `resumable`: only a client retry can finish it.
#[idempotent(scope = "shop.orders.refund", key = key, lease = "1s", skip(entered))]
async fn refund(
    db: &DatabaseConnection,
    entered: &Arc<Notify>,
    key: String,
) -> Result<String, PayError> {
    let _ = (db, key);
    entered.notify_one();
    std::future::pending::<()>().await;
    Ok("refunded".to_owned())
}

/// A resumable call whose stored arguments a later deploy no longer reads: a completer gives
/// it up.
#[idempotent(scope = "shop.orders.notify", key = key, lease = "1s", resumable, skip(entered))]
async fn notify(
    db: &DatabaseConnection,
    entered: &Arc<Notify>,
    key: String,
) -> Result<String, PayError> {
    let _ = (db, key);
    entered.notify_one();
    std::future::pending::<()>().await;
    Ok("notified".to_owned())
}

/// Starts `call`, waits until its body is in, and drops it: a holder that crashed.
async fn abandon(entered: Arc<Notify>, call: impl Future<Output = ()> + Send + 'static) {
    let held = tokio::spawn(call);
    entered.notified().await;
    held.abort();
    let _ = held.await;
}

/// What the service did on one database before the operator looks.
async fn record_calls(db: &DatabaseConnection) {
    let receipt = pay(db, "K-paid".into(), "o-1".into(), 1250)
        .await
        .expect("pay");
    assert_eq!(receipt.amount_cents, 1250);
    let declined = pay(db, "K-declined".into(), "o-2".into(), -1).await;
    assert!(matches!(declined, Err(PayError::Declined { .. })));
    // A message the broker refuses, and a relay that makes it dead at its first attempt.
    db.stage(
        Message::json(
            "shop.orders.refused",
            &serde_json::json!({ "order": "o-3" }),
        )
        .expect("message"),
    )
    .await
    .expect("stage");
    let sink = FnSink::new(|message: OutboxMessage| async move {
        if message.topic == "shop.orders.refused" {
            Err(SinkError::permanent(
                "the broker refused it: no such stream",
            ))
        } else {
            Ok(())
        }
    });
    let round = Relay::new(db.clone(), sink)
        .max_attempts(1)
        .run_once()
        .await
        .expect("relay round");
    assert_eq!((round.published, round.dead), (1, 1), "{round:?}");
    // Two holders that crash: one resumable, one not.
    let entered = Arc::new(Notify::new());
    let (db1, e1) = (db.clone(), entered.clone());
    abandon(entered.clone(), async move {
        let _ = ship(&db1, &e1, "K-ship".into(), "o-4".into()).await;
    })
    .await;
    let (db2, e2) = (db.clone(), entered.clone());
    abandon(entered.clone(), async move {
        let _ = refund(&db2, &e2, "K-refund".into()).await;
    })
    .await;
    let (db3, e3) = (db.clone(), entered.clone());
    abandon(entered, async move {
        let _ = notify(&db3, &e3, "K-notify".into()).await;
    })
    .await;
    // The 1 s leases end (renewals stopped with the holders).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A completer for the third scope expects other arguments: it gives the call up after
    // one attempt, and its give-up hook fails, so the hook stays owed.
    let completer = Completer::new(SeaOrmLeaseStore::new(db.clone()))
        .backoff(Duration::ZERO, Duration::ZERO)
        .max_attempts(1)
        .resume(
            "shop.orders.notify",
            |call: Resumed<(u64, u64)>| async move {
                let _ = call.args;
                Ok::<(), String>(())
            },
        )
        .on_give_up(|_: GaveUp| async { Err::<(), _>("the mail service is down") });
    let mut rounds = 0;
    while completer.run_once().await.expect("completer round").gave_up == 0 {
        rounds += 1;
        assert!(rounds < 20, "the completer did not give the call up");
    }
}

#[tokio::test]
async fn an_operator_inspects_records_leases_and_the_outbox_and_purges() {
    for database in isolated(true).await {
        let name = database.backend;
        record_calls(&database.db).await;

        // Was the payment run? Completed, with its answer.
        let found = database.idem(&["inspect", "--scope", "shop.orders.pay", "--key", "K-paid"]);
        found
            .exits(0)
            .prints("state        completed (1)")
            .prints("\"amount_cents\": 1250")
            .prints("replays      not recorded")
            .prints("expires      ");
        let json = database
            .idem(&[
                "--json",
                "inspect",
                "--scope",
                "shop.orders.pay",
                "--key",
                "K-paid",
            ])
            .exits(0)
            .json();
        assert_eq!(json["state_code"], 1, "{name}");
        assert_eq!(json["answer"]["order"], "o-1", "{name}");
        assert_eq!(json["replays"], Value::Null, "{name}");
        assert_eq!(
            json["fingerprint"].as_str().map(str::len),
            Some(64),
            "{name}"
        );

        // A final error is shown as the answer every retry gets.
        database
            .idem(&[
                "inspect",
                "--scope",
                "shop.orders.pay",
                "--key",
                "K-declined",
            ])
            .exits(0)
            .prints("failed (final error) (2)")
            .prints("answer (final error")
            .prints("card declined");

        // An unknown key: exit 1, in both forms.
        // A give-up: the attempts and the reason, and the hook still owed.
        database
            .idem(&[
                "inspect",
                "--scope",
                "shop.orders.notify",
                "--key",
                "K-notify",
            ])
            .exits(0)
            .prints("gave up (3)")
            .prints("gave up      after 1 completer attempt: ")
            .prints("give-up hook owed");
        let json = database
            .idem(&[
                "inspect",
                "--json",
                "--scope",
                "shop.orders.notify",
                "--key",
                "K-notify",
            ])
            .exits(0)
            .json();
        assert_eq!(json["answer"]["attempts"], 1, "{name}: {json}");
        assert_eq!(json["call"]["give_up_hook_owed"], true, "{name}: {json}");

        let missing = database.idem(&["inspect", "--scope", "shop.orders.pay", "--key", "nope"]);
        missing.exits(1);
        assert!(
            missing.stderr.contains("no record for scope"),
            "{name}: {}",
            missing.stderr
        );
        let missing = database.idem(&["--json", "inspect", "--scope", "x", "--key", "nope"]);
        assert_eq!(missing.exits(1).json()["found"], false, "{name}");

        // The leases that ended: the resumable one a completer can finish, the other only a
        // client retry.
        database
            .idem(&["leases"])
            .exits(0)
            .prints("2 leases ended")
            .prints("completer or client retry (0 attempts)")
            .prints("client retry only");
        let leases = database.idem(&["leases", "--json"]).exits(0).json();
        let leases = leases.as_array().expect("an array");
        assert_eq!(leases.len(), 2, "{name}: {leases:?}");
        let shipped = leases
            .iter()
            .find(|lease| lease["key"] == "K-ship")
            .expect("the resumable lease");
        assert_eq!(shipped["resumable"], true, "{name}");
        assert!(shipped["ended_ms_ago"].as_i64() >= Some(0), "{name}");
        let refunded = leases
            .iter()
            .find(|lease| lease["key"] == "K-refund")
            .expect("the other lease");
        assert_eq!(refunded["resumable"], false, "{name}");

        // The abandoned call by its id: in progress, its lease ended, its step and stored call.
        let id = shipped["id"].as_str().expect("id");
        database
            .idem(&["inspect", "--id", id])
            .exits(0)
            .prints("in progress (0)")
            .prints("ended ")
            .prints("a completer (resumable call) or a client retry takes it over")
            .prints("resumable; 0 completer attempts; due now for a completer")
            .prints("steps (1)")
            .prints("\"label-o-4\"")
            .prints("answer       none yet");
        let json = database
            .idem(&["inspect", "--id", id, "--json"])
            .exits(0)
            .json();
        assert_eq!(json["lease"]["ended"], true, "{name}");
        assert_eq!(json["steps"][0]["name"], "label", "{name}");
        assert_eq!(json["call"]["args"][0], "K-ship", "{name}: {json}");

        // The outbox: one dead message, with its error; retried, it is pending again.
        database
            .idem(&["outbox"])
            .exits(0)
            .prints("pending  0")
            .prints("dead     1");
        let dead = database.idem(&["outbox", "dead"]);
        dead.exits(0)
            .prints("shop.orders.refused")
            .prints("the broker refused it: no such stream");
        let dead = database.idem(&["outbox", "dead", "--json"]).exits(0).json();
        let message_id = dead[0]["id"].as_str().expect("a dead message").to_owned();
        database
            .idem(&["outbox", "retry", &message_id])
            .exits(0)
            .prints("back in line");
        database.idem(&["outbox", "retry", &message_id]).exits(1);
        let health = database.idem(&["outbox", "--json"]).exits(0).json();
        assert_eq!(
            (health["pending"].as_u64(), health["dead"].as_u64()),
            (Some(1), Some(0)),
            "{name}"
        );
        database
            .idem(&["outbox", "retry", "--all-dead"])
            .exits(0)
            .prints("0 dead messages back in line");
        database
            .idem(&["outbox", "purge", "--older-than", "0s"])
            .exits(0)
            .prints("deleted 1 message published more than 0ms ago");

        // A day later every TTL has passed. The purge deletes the records that ended (the
        // payment and the declined one), batch by batch, and keeps what is not finished: the
        // two leases that ended unfinished (their steps and stored call with them) and the
        // give-up whose hook is owed.
        database
            .db
            .execute_unprepared("UPDATE idem_ledger SET expires_at_ms = 0")
            .await
            .expect("expire every record");
        let purged = database
            .idem(&["purge", "--batch", "1", "--json"])
            .exits(0)
            .json();
        assert_eq!(purged["deleted"], 2, "{name}: {purged}");
        assert!(purged["statements"].as_u64() >= Some(2), "{name}: {purged}");
        database
            .idem(&["inspect", "--scope", "shop.orders.pay", "--key", "K-paid"])
            .exits(1);
        database.idem(&["leases"]).exits(0).prints("2 leases ended");
        database
            .idem(&["inspect", "--id", id])
            .exits(0)
            .prints("steps (1)");
        database
            .idem(&[
                "inspect",
                "--scope",
                "shop.orders.notify",
                "--key",
                "K-notify",
            ])
            .exits(0)
            .prints("give-up hook owed");
        database
            .idem(&["purge"])
            .exits(0)
            .prints("purged 0 ended records in 1 statement")
            .prints("idem leases");
        database.drop_database().await;
    }
}

/// A lease-mode call whose holder hangs (a step awaiting a call that never returns): its
/// renewals keep the lease alive.
#[idempotent(scope = "shop.orders.hang", key = key, lease = "3s", skip(entered))]
async fn hang(
    db: &DatabaseConnection,
    entered: &Arc<Notify>,
    key: String,
) -> Result<String, PayError> {
    let _ = (db, key);
    idem::step("call", |_| async {
        entered.notify_one();
        std::future::pending::<()>().await;
        Ok::<_, PayError>(())
    })
    .await?;
    Ok("done".to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_a_hung_holder_and_releases_its_lease() {
    for database in isolated(true).await {
        let name = database.backend;
        let entered = Arc::new(Notify::new());
        let (db, notified) = (database.db.clone(), entered.clone());
        let held = tokio::spawn(async move { hang(&db, &notified, "K-hung".into()).await });
        entered.notified().await;

        // Not listed under the default threshold; listed with a short one.
        let listed = database.idem(&["leases"]);
        listed.exits(0);
        assert!(
            !listed.stdout.contains("K-hung"),
            "{name}: {}",
            listed.stdout
        );
        database
            .idem(&["leases", "--stuck-after", "0s"])
            .exits(0)
            .prints("1 live lease held for longer than")
            .prints("K-hung");
        let json = database
            .idem(&["leases", "--stuck-after", "0s", "--json"])
            .exits(0)
            .json();
        let stuck = &json.as_array().expect("an array")[0];
        assert_eq!(
            (&stuck["key"], &stuck["stuck"]),
            (&Value::from("K-hung"), &Value::Bool(true)),
            "{name}"
        );

        database
            .idem(&["release", "--scope", "shop.orders.hang", "--key", "K-hung"])
            .exits(0)
            .prints("released the lease of");
        // Released: the lease ended at once (a retry takes over), and nothing is left to release.
        database
            .idem(&["leases", "--stuck-after", "0s"])
            .exits(0)
            .prints("1 lease ended")
            .prints("K-hung");
        let again = database.idem(&["release", "--scope", "shop.orders.hang", "--key", "K-hung"]);
        again.exits(1);
        assert!(
            again.stderr.contains("no live lease"),
            "{name}: {}",
            again.stderr
        );
        held.abort();
        let _ = held.await;
        database.drop_database().await;
    }
}

#[tokio::test]
async fn errors_are_one_line_with_exit_code_2() {
    // A database without idem's tables names them and the fix, on every backend.
    for database in isolated(false).await {
        database
            .idem(&["inspect", "--scope", "shop.orders.pay", "--key", "K"])
            .fails_on_one_line("no `idem_ledger` table")
            .fails_on_one_line("idem::sea_orm::create_tables");
        // The ledger is all `leases` and `purge` need (a schema of atomic calls has no other).
        database
            .idem(&["leases"])
            .fails_on_one_line("no `idem_ledger` table");
        database
            .idem(&["purge"])
            .fails_on_one_line("no `idem_ledger` table");
        database
            .idem(&["outbox"])
            .fails_on_one_line("no `idem_outbox` table");
        database.drop_database().await;
    }
    run_idem(
        &["schema", "--backend", "postgres", "--only", "ledger,steps"],
        "any",
    )
    .exits(2);
    run_idem(&["--url", "nonsense://somewhere", "leases"], "any")
        .fails_on_one_line("must start with postgres://");
    run_idem(
        &["--url", "sqlite:///nonexistent/dir/idem.db", "leases"],
        "sqlite",
    )
    .fails_on_one_line("cannot connect to the sqlite database");
    run_idem(
        &["--url", "postgres://idem:secret@127.0.0.1:1/shop", "leases"],
        "postgres",
    )
    .fails_on_one_line("cannot connect to the postgres database within 10s");
    run_idem(&["leases"], "any").fails_on_one_line("set DATABASE_URL or pass --url");
    // Bad arguments are clap's (several lines of usage), still exit 2.
    run_idem(&["inspect", "--id", "not-hex"], "any").exits(2);
}

#[test]
fn help_documents_the_exit_codes_and_the_database_url() {
    let help = run_idem(&["--help"], "any");
    help.exits(0)
        .prints("0  ok")
        .prints("1  not found")
        .prints("2  error")
        .prints("DATABASE_URL");
}

/// A receipt whose type is at its second version: recorded behind a `v2:` envelope.
#[derive(Debug, Serialize, Deserialize)]
struct ReceiptV2 {
    order: String,
    cents: i64,
}

impl idem::Versioned for ReceiptV2 {
    const VERSION: u32 = 2;
}

#[idempotent(scope = "shop.orders.pay-v2", key = key)]
async fn pay_v2(db: &DatabaseConnection, key: String, cents: i64) -> Result<ReceiptV2, PayError> {
    let _ = db;
    Ok(ReceiptV2 {
        order: "o-v2".to_owned(),
        cents,
    })
}

/// A log line's bytes, kept for the test to read.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(
            &self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
        .into_owned()
    }
}

/// A dispatcher that lives as long as the test process. While only one dispatcher exists,
/// tracing computes a callsite's interest with the default of whichever thread reaches the
/// callsite first: a concurrent test without a subscriber that enters the call's span first
/// would switch the span off for this test's scoped subscriber too (the log came out empty in
/// CI). With a second dispatcher registered, tracing asks every subscriber instead.
static SECOND_DISPATCHER: std::sync::LazyLock<tracing::Dispatch> = std::sync::LazyLock::new(|| {
    tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default())
});

/// Records one response through idem's tower layer on an axum route, as a service's HTTP
/// front door does: a 201 with a JSON body, for the key `key` as the client sent it.
async fn record_through_the_layer(db: &DatabaseConnection, key: &str) {
    use axum::Json;
    use axum::http::{Request, StatusCode};
    use tower::ServiceExt as _;

    let layer =
        idem::axum::IdempotencyLayer::new(SeaOrmLeaseStore::new(db.clone()), "shop.http.orders");
    let router = axum::Router::new().route(
        "/orders",
        axum::routing::post(|| async {
            (
                StatusCode::CREATED,
                Json(serde_json::json!({ "id": 7, "state": "placed" })),
            )
        })
        .route_layer(layer),
    );
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(r#"{"sku":"tea"}"#))
        .expect("request");
    let response = router.oneshot(request).await.expect("response");
    assert_eq!(response.status(), StatusCode::CREATED);
}

#[tokio::test]
async fn an_operator_goes_from_a_log_line_to_its_record() {
    use tracing_subscriber::fmt::format::FmtSpan;

    for database in isolated(true).await {
        let name = database.backend;
        // The service's log, as its operator reads it: the call's span carries `key_hash`.
        std::sync::LazyLock::force(&SECOND_DISPATCHER);
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_span_events(FmtSpan::CLOSE)
            .finish();
        {
            let _logging = tracing::subscriber::set_default(subscriber);
            pay(&database.db, "K-log".into(), "o-9".into(), 990)
                .await
                .expect("pay");
        }
        let text = log.text();
        let key_hash = text
            .split_once("key_hash=")
            .map(|(_, rest)| {
                rest.chars()
                    .take_while(char::is_ascii_hexdigit)
                    .collect::<String>()
            })
            .unwrap_or_else(|| panic!("{name}: no key_hash in the log:\n{text}"));
        assert_eq!(key_hash.len(), 16, "{name}: {text}");
        assert!(
            !text.contains("K-log"),
            "{name}: the log shows the key:\n{text}"
        );

        // The log's id finds the record.
        database
            .idem(&["inspect", "--id", &key_hash])
            .exits(0)
            .prints("key          K-log")
            .prints("\"amount_cents\": 990");
        let json = database
            .idem(&["inspect", "--json", "--id", &key_hash.to_uppercase()])
            .exits(0)
            .json();
        assert_eq!(json["key"], "K-log", "{name}");
        assert!(
            json["id"]
                .as_str()
                .is_some_and(|id| id.starts_with(&key_hash)),
            "{name}: {json}"
        );

        // Enough records that two ids share their first digit: a prefix that is not unique is
        // refused and names the records it could mean.
        for n in 0..16 {
            pay(&database.db, format!("K-many-{n}"), format!("o-{n}"), 100)
                .await
                .expect("pay");
        }
        let declined = pay(&database.db, "K-no".into(), "o-x".into(), -5).await;
        assert!(matches!(declined, Err(PayError::Declined { .. })), "{name}");
        let listed = database
            .idem(&[
                "list",
                "--json",
                "--scope",
                "shop.orders.pay",
                "--since",
                "1h",
            ])
            .exits(0)
            .json();
        let listed = listed.as_array().expect("an array");
        assert_eq!(listed.len(), 18, "{name}: {listed:?}");
        let first_digits: Vec<char> = listed
            .iter()
            .filter_map(|r| r["id"].as_str().and_then(|id| id.chars().next()))
            .collect();
        let shared = first_digits
            .iter()
            .find(|d| first_digits.iter().filter(|e| e == d).count() > 1)
            .expect("17 ids over 16 digits");
        database
            .idem(&["inspect", "--id", &shared.to_string()])
            .fails_on_one_line("records start with")
            .fails_on_one_line("give more digits");
        database
            .idem(&["inspect", "--id", "0123456789abcdef0123"])
            .exits(1);

        // The list: newest first, by state, as a table.
        let failed = database
            .idem(&[
                "list",
                "--json",
                "--scope",
                "shop.orders.pay",
                "--state",
                "failed",
            ])
            .exits(0)
            .json();
        let failed = failed.as_array().expect("an array");
        assert_eq!(failed.len(), 1, "{name}: {failed:?}");
        assert_eq!(failed[0]["key"], "K-no", "{name}");
        let claimed: Vec<i64> = listed
            .iter()
            .filter_map(|r| r["created_at_ms"].as_i64())
            .collect();
        assert!(
            claimed.len() == 18 && claimed.windows(2).all(|w| w[0] >= w[1]),
            "{name}: newest first: {claimed:?}"
        );
        database
            .idem(&[
                "list",
                "--scope",
                "shop.orders.pay",
                "--state",
                "completed",
                "--limit",
                "3",
            ])
            .exits(0)
            .prints("3 records of shop.orders.pay")
            .prints("completed")
            .prints("K-many-15");
        database
            .idem(&["list", "--scope", "shop.orders.nothing"])
            .exits(0)
            .prints("no records of shop.orders.nothing claimed in the last 1d");

        // A key the tool cannot find says which calls leave no record.
        let missing = database.idem(&["inspect", "--scope", "shop.orders.pay", "--key", "nope"]);
        missing.exits(1);
        for case in [
            "never claimed",
            "rolled back",
            "invalid-transition",
            "purged",
        ] {
            assert!(
                missing.stderr.contains(case),
                "{name}: {case}: {}",
                missing.stderr
            );
        }

        // An answer of a versioned type: its JSON and its version, not the envelope's bytes.
        pay_v2(&database.db, "K-v2".into(), 4200)
            .await
            .expect("pay v2");
        database
            .idem(&["inspect", "--scope", "shop.orders.pay-v2", "--key", "K-v2"])
            .exits(0)
            .prints("answer ver.  2")
            .prints("\"cents\": 4200");
        let json = database
            .idem(&[
                "inspect",
                "--json",
                "--scope",
                "shop.orders.pay-v2",
                "--key",
                "K-v2",
            ])
            .exits(0)
            .json();
        assert_eq!(
            (
                json["answer"]["cents"].as_i64(),
                json["answer_version"].as_u64()
            ),
            (Some(4200), Some(2)),
            "{name}: {json}"
        );

        // A response the layer recorded: found by the key as the client's header carried it
        // (a structured-field string, quotes and all), and shown as HTTP.
        record_through_the_layer(&database.db, "\"L-1\"").await;
        let shown = database.idem(&["inspect", "--scope", "shop.http.orders", "--key", "\"L-1\""]);
        shown
            .exits(0)
            .prints("key          L-1")
            .prints("HTTP 201")
            .prints("content-type: application/json")
            .prints("\"state\": \"placed\"");
        assert!(
            !shown.stdout.contains("[97,"),
            "{name}: bytes:\n{}",
            shown.stdout
        );
        let json = database
            .idem(&[
                "inspect",
                "--json",
                "--scope",
                "shop.http.orders",
                "--key",
                "L-1",
            ])
            .exits(0)
            .json();
        assert_eq!(json["answer"]["status"], 201, "{name}: {json}");
        assert_eq!(
            json["answer"]["headers"]["content-type"], "application/json",
            "{name}: {json}"
        );
        assert_eq!(json["answer"]["body"]["id"], 7, "{name}: {json}");
        database.drop_database().await;
    }
}

/// An atomic-mode call: it needs the ledger table and nothing else.
#[idempotent(scope = "shop.orders.charge", key = key)]
async fn charge(
    db: &DatabaseConnection,
    key: String,
    amount_cents: i64,
) -> Result<Receipt, PayError> {
    let _ = db;
    Ok(Receipt {
        order: key,
        amount_cents,
    })
}

/// How many ledger rows `db` holds.
async fn ledger_rows(db: &DatabaseConnection) -> i64 {
    db.query_one_raw(sea_orm::Statement::from_string(
        db.get_database_backend(),
        "SELECT COUNT(*) FROM idem_ledger",
    ))
    .await
    .expect("count")
    .expect("a row")
    .try_get_by_index::<i64>(0)
    .expect("a count")
}

#[tokio::test]
async fn a_service_of_atomic_calls_runs_on_the_ledger_alone() {
    for database in isolated(false).await {
        let name = database.backend;
        // The DDL the service puts in its own migrations: the ledger alone, as shipped in
        // idem-sql/schema/.
        let ddl = run_idem(&["schema", "--backend", name, "--only", "ledger"], name);
        ddl.exits(0)
            .prints("CREATE TABLE IF NOT EXISTS idem_ledger");
        let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../idem-sql/schema")
            .join(name)
            .join("ledger.sql");
        assert_eq!(
            ddl.stdout,
            std::fs::read_to_string(&shipped).expect("the shipped schema file"),
            "{name}: `idem schema` prints the shipped file"
        );
        for table in ["idem_steps", "idem_calls", "idem_outbox"] {
            assert!(
                !ddl.stdout.contains(table),
                "{name}: {table} in {}",
                ddl.stdout
            );
        }
        for statement in ddl.stdout.split(";\n") {
            let statement: String = statement
                .lines()
                .filter(|line| !line.starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n");
            if !statement.trim().is_empty() {
                database
                    .db
                    .execute_unprepared(&statement)
                    .await
                    .unwrap_or_else(|e| panic!("{name}: {statement}: {e}"));
            }
        }

        // Calls claim, record and replay on it.
        let first = charge(&database.db, "K-alone".into(), 700)
            .await
            .expect("charge");
        let again = charge(&database.db, "K-alone".into(), 700)
            .await
            .expect("replay");
        assert_eq!(first, again, "{name}");
        assert_eq!(ledger_rows(&database.db).await, 1, "{name}");

        // The operator's commands work on it: no leases, and the purge deletes the record
        // once its TTL passed (it failed on the missing steps and calls tables before).
        database
            .idem(&["leases"])
            .exits(0)
            .prints("no leases ended");
        database
            .db
            .execute_unprepared("UPDATE idem_ledger SET expires_at_ms = 0")
            .await
            .expect("expire");
        database
            .idem(&["purge"])
            .exits(0)
            .prints("purged 1 ended record");
        assert_eq!(ledger_rows(&database.db).await, 0, "{name}: purged");
        database.drop_database().await;
    }
}
