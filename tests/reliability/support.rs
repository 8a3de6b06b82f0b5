//! Plumbing of the reliability suite (`tests/reliability.rs`, docs/RELIABILITY.md): the
//! backends (`crate::common`'s, with the suite's tables), an effects table the handlers write to, single-snapshot counts of effects and
//! ledger states, a seeded PRNG, and the child processes of R2/R3 (the suite's own test
//! binary, re-executed). The handlers are in `stores.rs`.
//!
//! Every count is read in ONE statement, so a commit can never fall between two of its
//! figures.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, Value};
use serde::{Deserialize, Serialize};

/// The scope of the shared handler.
pub const SCOPE: &str = "rel.transfer";

/// One database of the run, with its URL (children connect to it themselves).
pub use crate::common::Backend;
/// A string unique to this process and call; a pool on a URL.
pub use crate::common::{connect, unique};

/// Whether the quick sizes were asked for (`IDEM_RELIABILITY_QUICK=1`, for local
/// iteration). By default the suite runs the full sizes: they take well under a
/// minute on all three backends.
pub fn quick() -> bool {
    std::env::var("IDEM_RELIABILITY_QUICK").is_ok_and(|v| v == "1")
}

/// A fresh SQLite file of its own: its URL.
pub fn sqlite_url() -> String {
    crate::common::sqlite_url("idem-rel")
}

/// Every backend of this run (`crate::common::connect_all`: SQLite always, servers when
/// their variables are set, a set but unreachable server fails), with the ledger and the
/// effects table in place.
pub async fn backends(max: u32) -> Vec<Backend> {
    let all = crate::common::connect_all("idem-rel", max).await;
    for b in &all {
        prepare(&b.db).await;
    }
    all
}

/// The server backends of this run only (for tests that need a server).
pub async fn servers(max: u32) -> Vec<Backend> {
    let mut all = backends(max).await;
    all.retain(|b| b.name != "sqlite");
    all
}

/// Creates the ledger and the effects table (tolerant of other tests doing it at once).
pub async fn prepare(db: &DatabaseConnection) {
    let ddl: &[&str] = match db.get_database_backend() {
        DbBackend::Postgres => &[
            "CREATE TABLE IF NOT EXISTS idem_rel_effects (id BIGSERIAL PRIMARY KEY, \
             run_id VARCHAR(120) NOT NULL, k VARCHAR(255) NOT NULL, label VARCHAR(32) NOT NULL, \
             execution VARCHAR(120) NOT NULL)",
            "CREATE INDEX IF NOT EXISTS idem_rel_effects_run ON idem_rel_effects (run_id, k)",
        ],
        DbBackend::MySql => &[
            "CREATE TABLE IF NOT EXISTS idem_rel_effects (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             run_id VARCHAR(120) NOT NULL, k VARCHAR(255) NOT NULL, label VARCHAR(32) NOT NULL, \
             execution VARCHAR(120) NOT NULL, INDEX idem_rel_effects_run (run_id, k)) \
             ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
        ],
        _ => &[
            "CREATE TABLE IF NOT EXISTS idem_rel_effects (id INTEGER PRIMARY KEY AUTOINCREMENT, \
             run_id TEXT NOT NULL, k TEXT NOT NULL, label TEXT NOT NULL, execution TEXT NOT NULL)",
            "CREATE INDEX IF NOT EXISTS idem_rel_effects_run ON idem_rel_effects (run_id, k)",
        ],
    };
    crate::common::prepare_with(db, ddl).await;
}

/// `sql` with `?` placeholders numbered for PostgreSQL.
pub fn sql(backend: DbBackend, template: &str) -> String {
    idem::sea_orm::placeholders(backend, template)
}

/// A statement for `db`'s backend.
pub fn stmt<C: ConnectionTrait>(db: &C, template: &str, values: Vec<Value>) -> Statement {
    let backend = db.get_database_backend();
    Statement::from_sql_and_values(backend, sql(backend, template), values)
}

/// Writes one effect row in `db` (inside a handler: the claim's transaction).
pub async fn effect<C: ConnectionTrait>(
    db: &C,
    run: &str,
    key: &str,
    label: &str,
    execution: &str,
) -> Result<(), idem::Error> {
    db.execute_raw(stmt(
        db,
        "INSERT INTO idem_rel_effects (run_id, k, label, execution) VALUES (?, ?, ?, ?)",
        vec![run.into(), key.into(), label.into(), execution.into()],
    ))
    .await
    .map(drop)
    .map_err(|e| idem::Error::store("writing an effect", e))
}

/// What the database holds for a run (effects) and its keys (ledger), read in one
/// statement. Ledger rows are those of `scope` whose key starts with `key_prefix`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// Effect rows.
    pub effects: i64,
    /// Distinct executions that wrote effects.
    pub executions: i64,
    /// Ledger rows in state 0 (claimed, not finished).
    pub pending: i64,
    /// Ledger rows in state 1 (result recorded).
    pub completed: i64,
    /// Ledger rows in any other state.
    pub other: i64,
}

/// Reads the [`Snapshot`] of `run` (effects with `run_id = run`, and `key` = exact key when
/// given) and of the ledger rows of `scope` whose key is `key` or starts with `run-`.
pub async fn snapshot(
    db: &DatabaseConnection,
    scope: &str,
    run: &str,
    key: Option<&str>,
) -> Snapshot {
    let (effect_filter, ledger_filter, mut values): (&str, &str, Vec<Value>) = match key {
        Some(k) => (
            "run_id = ? AND k = ?",
            "scope = ? AND idem_key = ?",
            vec![run.into(), k.into()],
        ),
        None => (
            "run_id = ?",
            "scope = ? AND idem_key LIKE ?",
            vec![run.into()],
        ),
    };
    let ledger_value = |v: &mut Vec<Value>| {
        v.push(scope.into());
        v.push(match key {
            Some(k) => k.into(),
            None => format!("{run}-%").into(),
        });
    };
    let effects_again = values.clone();
    values.extend(effects_again);
    for _ in 0..3 {
        ledger_value(&mut values);
    }
    let query = format!(
        "SELECT \
         (SELECT COUNT(*) FROM idem_rel_effects WHERE {effect_filter}), \
         (SELECT COUNT(DISTINCT execution) FROM idem_rel_effects WHERE {effect_filter}), \
         (SELECT COUNT(*) FROM idem_ledger WHERE {ledger_filter} AND state = 0), \
         (SELECT COUNT(*) FROM idem_ledger WHERE {ledger_filter} AND state = 1), \
         (SELECT COUNT(*) FROM idem_ledger WHERE {ledger_filter} AND state NOT IN (0, 1))"
    );
    let row = db
        .query_one_raw(stmt(db, &query, values))
        .await
        .expect("snapshot query")
        .expect("snapshot row");
    let get = |i: usize| row.try_get_by_index::<i64>(i).expect("a count");
    Snapshot {
        effects: get(0),
        executions: get(1),
        pending: get(2),
        completed: get(3),
        other: get(4),
    }
}

/// Effect rows per key of `run`.
pub async fn effects_per_key(db: &DatabaseConnection, run: &str) -> BTreeMap<String, i64> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT k, COUNT(*) FROM idem_rel_effects WHERE run_id = ? GROUP BY k",
            vec![run.into()],
        ))
        .await
        .expect("effects per key");
    rows.iter()
        .map(|r| {
            (
                r.try_get_by_index::<String>(0).expect("k"),
                r.try_get_by_index::<i64>(1).expect("count"),
            )
        })
        .collect()
}

/// The raw ledger row of `(scope, key)`: owner, fingerprint, state, response, expires_at_ms.
pub type LedgerRow = (i64, Vec<u8>, i16, Option<Vec<u8>>, i64);

/// Reads the ledger row of `(scope, key)` in any principal, if there is exactly one.
pub async fn ledger_row(db: &DatabaseConnection, scope: &str, key: &str) -> Option<LedgerRow> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT owner, fingerprint, state, response, expires_at_ms FROM idem_ledger \
             WHERE scope = ? AND idem_key = ?",
            vec![scope.into(), key.into()],
        ))
        .await
        .expect("ledger row");
    assert!(rows.len() <= 1, "{scope}/{key}: {} ledger rows", rows.len());
    rows.first().map(|r| {
        (
            r.try_get_by_index(0).expect("owner"),
            r.try_get_by_index(1).expect("fingerprint"),
            r.try_get_by_index(2).expect("state"),
            r.try_get_by_index(3).expect("response"),
            r.try_get_by_index(4).expect("expires_at_ms"),
        )
    })
}

/// The recorded answer of a completed `transfer` key.
pub async fn recorded_answer(db: &DatabaseConnection, key: &str) -> Option<Answer> {
    let (_, _, state, response, _) = ledger_row(db, SCOPE, key).await?;
    assert_eq!(state, 1, "{key}: recorded answers are in state 1");
    Some(serde_json::from_slice(&response.expect("a response")).expect("a recorded Answer"))
}

/// A small seeded PRNG (SplitMix64): every random choice of the suite comes from one, and
/// its seed is printed, so a failing schedule can be replayed with `IDEM_RELIABILITY_SEED`.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded from `IDEM_RELIABILITY_SEED` or the clock, mixed with `salt`; prints the seed.
    pub fn new(test: &str) -> Self {
        let seed = std::env::var("IDEM_RELIABILITY_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(7)
            });
        eprintln!("{test}: IDEM_RELIABILITY_SEED={seed}");
        Self::from_seed(seed ^ fnv(test))
    }

    /// A generator with this exact seed.
    pub fn from_seed(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `true` with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The arguments of the shared handler.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Transfer {
    pub key: String,
    pub run: String,
    pub amount: i64,
}

/// The shared handler's answer; `execution` differs between executions, so a replay is told
/// from a second execution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub key: String,
    pub amount: i64,
    pub execution: String,
}

/// Where a handler run reports its progress.
#[derive(Debug, Default)]
pub enum Probe {
    /// Nothing.
    #[default]
    Quiet,
    /// Yields to the scheduler at every point (more suspension points for R4).
    Yield,
    /// Prints `@@ AT <point>` at every point (a child process) and sleeps at `stop_at`.
    Markers {
        stop_at: Option<String>,
        sleep: Duration,
    },
}

impl Probe {
    /// Passes the named point.
    pub async fn at(&self, point: &str) {
        match self {
            Self::Quiet => {}
            Self::Yield => tokio::task::yield_now().await,
            Self::Markers { stop_at, sleep } => {
                println!("@@ AT {point}");
                if stop_at.as_deref() == Some(point) && !sleep.is_zero() {
                    tokio::time::sleep(*sleep).await;
                }
            }
        }
    }
}

/// The key of the `i`-th call target of a run.
pub fn key_of(run: &str, i: usize) -> String {
    format!("{run}-k{i}")
}

// ---------------------------------------------------------------------------------------
// Child processes (R2, R3): the suite's own test binary, re-executed with
// `IDEM_RELIABILITY_CHILD` set, runs `child_process` in tests/reliability.rs.

/// A running child process and the `@@ ` lines it printed.
pub struct ChildProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<(Instant, String)>,
    stderr: Arc<Mutex<String>>,
    /// Every `@@ ` line received so far.
    pub seen: Vec<String>,
    /// When each line of `seen` arrived.
    pub times: Vec<Instant>,
    pub started: Instant,
}

/// Starts the suite's test binary as a child running `child_process` with `env`.
pub fn spawn_child(env: &[(&str, String)]) -> ChildProc {
    let exe = std::env::current_exe().expect("the test binary");
    let mut command = Command::new(exe);
    command
        .args([
            "child_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("IDEM_RELIABILITY_CHILD", "1");
    for (k, v) in env {
        command.env(k, v);
    }
    let started = Instant::now();
    let mut child = command.spawn().expect("spawn the child process");
    let (tx, lines) = mpsc::channel();
    let stdout = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.strip_prefix("@@ ")
                && tx.send((Instant::now(), rest.to_owned())).is_err()
            {
                break;
            }
        }
    });
    let stderr = Arc::new(Mutex::new(String::new()));
    let sink = Arc::clone(&stderr);
    let err_pipe = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(err_pipe).lines() {
            let Ok(line) = line else { break };
            let mut s = sink.lock().expect("stderr sink");
            s.push_str(&line);
            s.push('\n');
        }
    });
    ChildProc {
        stdin: child.stdin.take(),
        child,
        lines,
        stderr,
        seen: Vec::new(),
        times: Vec::new(),
        started,
    }
}

/// A child that exited on its own.
pub struct Finished {
    pub status: ExitStatus,
    /// Its `@@ ` lines, without the prefix.
    pub lines: Vec<String>,
    /// When each line arrived.
    pub times: Vec<Instant>,
    pub stderr: String,
}

impl Finished {
    /// Time between the first lines starting with `from` and with `to`.
    pub fn between(&self, from: &str, to: &str) -> Option<Duration> {
        let at = |prefix: &str| self.lines.iter().position(|l| l.starts_with(prefix));
        let (a, b) = (at(from)?, at(to)?);
        self.times[b].checked_duration_since(self.times[a])
    }
}

impl ChildProc {
    fn push(&mut self, (at, line): (Instant, String)) {
        self.seen.push(line);
        self.times.push(at);
    }

    /// Waits until a line starting with `prefix` arrives; `None` on timeout or exit.
    pub fn wait_for(&mut self, prefix: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let line = self.lines.recv_timeout(left).ok()?;
            let found = line.1.starts_with(prefix).then(|| line.1.clone());
            self.push(line);
            if found.is_some() {
                return found;
            }
        }
    }

    /// Sends one line to the child's standard input.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").expect("write to the child");
        stdin.flush().expect("flush to the child");
    }

    /// Kills the child with SIGKILL, reaps it, and returns every line it printed and whether
    /// it had already exited on its own (a late kill).
    pub fn kill(mut self) -> (Vec<String>, bool) {
        // On Unix `Child::kill` sends SIGKILL; a child that already exited is a zombie until
        // reaped below, so the signal cannot hit another process.
        self.child.kill().expect("SIGKILL the child");
        let status = self.child.wait().expect("reap the child");
        self.drain();
        (self.seen, status.success())
    }

    /// Waits (bounded) for the child to exit on its own.
    pub fn finish(mut self, timeout: Duration) -> Finished {
        drop(self.stdin.take());
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("poll the child") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "child did not finish within {timeout:?}; lines: {:?}; stderr: {}",
                    self.seen,
                    self.stderr.lock().expect("stderr")
                );
            }
            while let Ok(line) = self.lines.try_recv() {
                self.push(line);
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        self.drain();
        let stderr = self.stderr.lock().expect("stderr").clone();
        Finished {
            status,
            lines: self.seen,
            times: self.times,
            stderr,
        }
    }

    fn drain(&mut self) {
        // The reader thread ends at EOF (the child's stdout closes when it dies).
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(10)) {
            self.push(line);
        }
    }
}

/// Parses `ANSWER <key> <outcome> <json>` lines.
pub fn answers(lines: &[String]) -> Vec<(String, String, Answer)> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("ANSWER "))
        .map(|rest| {
            let mut parts = rest.splitn(3, ' ');
            let key = parts.next().expect("key").to_owned();
            let outcome = parts.next().expect("outcome").to_owned();
            let answer = serde_json::from_str(parts.next().expect("json")).expect("an Answer");
            (key, outcome, answer)
        })
        .collect()
}
