//! The reliability suite (docs/RELIABILITY.md): storms, many processes, SIGKILL crashes,
//! cancellation at every poll, broken connections, bad input, isolation and properties.
//!
//! Every test counts effects in the database (`idem_rel_effects`, two rows per execution:
//! a partial write shows as an odd count) and checks the ledger for rows left in state 0.
//! SQLite always runs; PostgreSQL and MariaDB run when `IDEM_TEST_POSTGRES_URL` /
//! `IDEM_TEST_MYSQL_URL` are set (a set but unreachable server fails). Heavy cases have a
//! quick size with `IDEM_RELIABILITY_QUICK=1` for local iteration; by default they run
//! at the full size (well under a minute on all three backends). Both sizes assert
//! the same invariants. Random schedules print their seed; replay one with
//! `IDEM_RELIABILITY_SEED=<seed>`.

mod common;
#[path = "reliability/support.rs"]
mod support;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use idem::{ErrorKind, Outcome, idempotent, with_outcome};
use sea_orm::{ConnectionTrait, DatabaseConnection};
use serde::{Deserialize, Serialize};

use support::{
    Answer, Backend, Probe, Rng, SCOPE, Snapshot, Transfer, answers, backends, connect, effect,
    key_of, ledger_row, quick, recorded_answer, snapshot, spawn_child, stmt, transfer, unique,
};

fn outcome_name(outcome: Option<Outcome>) -> &'static str {
    match outcome {
        Some(Outcome::Executed) => "Executed",
        Some(Outcome::Replayed) => "Replayed",
        None => "None",
    }
}

fn cmd(run: &str, i: usize) -> Transfer {
    Transfer {
        key: key_of(run, i),
        run: run.to_owned(),
        amount: i as i64,
    }
}

/// Asserts the end state of a run in which every one of `keys` keys executed exactly once.
async fn assert_exactly_once(b: &Backend, run: &str, keys: usize, what: &str) -> Snapshot {
    let s = snapshot(&b.db, SCOPE, run, None).await;
    let keys = keys as i64;
    assert_eq!(
        s,
        Snapshot {
            effects: 2 * keys,
            executions: keys,
            pending: 0,
            completed: keys,
            other: 0,
        },
        "{} {what}: {keys} keys must give {keys} executions, {} effect rows, {keys} completed \
         records and no pending one",
        b.name,
        2 * keys
    );
    let per_key = support::effects_per_key(&b.db, run).await;
    assert_eq!(per_key.len() as i64, keys, "{}: every key executed", b.name);
    assert!(
        per_key.values().all(|&n| n == 2),
        "{}: two effect rows per key",
        b.name
    );
    s
}

/// Every recorded answer of a run, by key, in one query.
async fn recorded_answers(db: &DatabaseConnection, run: &str) -> BTreeMap<String, Answer> {
    let rows = db
        .query_all_raw(stmt(
            db,
            "SELECT idem_key, response FROM idem_ledger WHERE scope = ? AND idem_key LIKE ? \
             AND state = 1",
            vec![SCOPE.into(), format!("{run}-%").into()],
        ))
        .await
        .expect("recorded answers");
    rows.iter()
        .map(|r| {
            let key: String = r.try_get_by_index(0).expect("key");
            let bytes: Vec<u8> = r.try_get_by_index(1).expect("response");
            (key, serde_json::from_slice(&bytes).expect("an Answer"))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// The child process of R2 and R3: this test binary, re-executed by the parent.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of R2/R3: the parent runs it with IDEM_RELIABILITY_CHILD set"]
async fn child_process() {
    if std::env::var("IDEM_RELIABILITY_CHILD").is_err() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    println!("@@ START");
    match var("IDEM_REL_MODE").as_str() {
        "crash" => {
            let db = connect(&var("IDEM_REL_URL"), 2).await;
            let probe = Probe::Markers {
                stop_at: Some(var("IDEM_REL_STOP_AT")).filter(|s| s != "none"),
                sleep: Duration::from_millis(var("IDEM_REL_SLEEP_MS").parse().expect("ms")),
            };
            let cmd = Transfer {
                key: var("IDEM_REL_KEY"),
                run: var("IDEM_REL_RUN"),
                amount: var("IDEM_REL_AMOUNT").parse().expect("amount"),
            };
            probe.at("before-claim").await;
            let (result, outcome) = with_outcome(transfer(&db, cmd.clone(), &probe)).await;
            match result {
                Ok(answer) => println!(
                    "@@ ANSWER {} {} {}",
                    cmd.key,
                    outcome_name(outcome),
                    serde_json::to_string(&answer).expect("json")
                ),
                Err(e) => println!("@@ ERROR {} {e}", e.kind().as_str()),
            }
            probe.at("after-commit").await;
        }
        "worker" => {
            let concurrency: usize = var("IDEM_REL_CONCURRENCY").parse().expect("n");
            let db = connect(&var("IDEM_REL_URL"), concurrency as u32 + 1).await;
            let run = var("IDEM_REL_RUN");
            let keys: usize = var("IDEM_REL_KEYS").parse().expect("n");
            let mut order: Vec<usize> = (0..keys).collect();
            Rng::from_seed(var("IDEM_REL_SEED").parse().expect("seed")).shuffle(&mut order);
            println!("@@ READY");
            if var("IDEM_REL_WAIT_GO") == "1" {
                let mut go = String::new();
                std::io::stdin().read_line(&mut go).expect("GO");
            }
            let (order, next) = (Arc::new(order), Arc::new(AtomicUsize::new(0)));
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..concurrency {
                let (db, run, order, next) = (db.clone(), run.clone(), order.clone(), next.clone());
                tasks.spawn(async move {
                    let mut in_flight = 0_u64;
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(&k) = order.get(i) else { break };
                        let cmd = cmd(&run, k);
                        loop {
                            match with_outcome(transfer(&db, cmd.clone(), &Probe::Quiet)).await {
                                (Ok(a), outcome) => {
                                    println!(
                                        "@@ ANSWER {} {} {}",
                                        cmd.key,
                                        outcome_name(outcome),
                                        serde_json::to_string(&a).expect("json")
                                    );
                                    break;
                                }
                                (Err(e), _) if e.kind() == ErrorKind::InFlight => {
                                    in_flight += 1;
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                }
                                (Err(e), _) => {
                                    println!("@@ ERROR {} {} {e}", cmd.key, e.kind().as_str());
                                    break;
                                }
                            }
                        }
                    }
                    in_flight
                });
            }
            let in_flight: u64 = tasks.join_all().await.into_iter().sum();
            println!("@@ DONE in_flight={in_flight}");
        }
        other => panic!("unknown child mode {other}"),
    }
    println!("@@ EXIT");
}

// ---------------------------------------------------------------------------------------
// R1 storm

#[derive(Debug, Default)]
struct StormStats {
    answers: Vec<(usize, Answer, Option<Outcome>)>,
    cancelled: u64,
    in_flight: u64,
    errors: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn r1_storm_executes_each_key_once() {
    let (calls, keys, tasks_n) = if quick() {
        (2_000, 200, 64)
    } else {
        (10_000, 1_000, 64)
    };
    for b in backends(24).await {
        let started = Instant::now();
        let run = unique("r1");
        let mut rng = Rng::new("r1");
        // Each key `calls / keys` times, shuffled: duplicates land on concurrent tasks at
        // random. One call in ten is an impatient client: it gives up after 0..4 ms (the
        // future is dropped wherever it is) and retries.
        let mut schedule: Vec<(usize, Option<u64>)> =
            (0..calls).map(|i| (i % keys, None)).collect();
        rng.shuffle(&mut schedule);
        for item in &mut schedule {
            if rng.chance(10) {
                item.1 = Some(rng.below(4_000));
            }
        }
        let (schedule, next) = (Arc::new(schedule), Arc::new(AtomicUsize::new(0)));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..tasks_n {
            let (db, run, schedule, next) =
                (b.db.clone(), run.clone(), schedule.clone(), next.clone());
            tasks.spawn(async move {
                let mut stats = StormStats::default();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(&(k, mut impatience)) = schedule.get(i) else {
                        break;
                    };
                    let cmd = cmd(&run, k);
                    let mut attempts = 0;
                    loop {
                        attempts += 1;
                        assert!(attempts < 1_000, "key {k} never answered");
                        let call = with_outcome(transfer(&db, cmd.clone(), &Probe::Quiet));
                        let result = match impatience.take() {
                            Some(us) => {
                                match tokio::time::timeout(Duration::from_micros(us), call).await {
                                    Ok(result) => result,
                                    Err(_) => {
                                        stats.cancelled += 1;
                                        continue;
                                    }
                                }
                            }
                            None => call.await,
                        };
                        match result {
                            (Ok(answer), outcome) => {
                                stats.answers.push((k, answer, outcome));
                                break;
                            }
                            (Err(e), _) if e.kind() == ErrorKind::InFlight => {
                                stats.in_flight += 1;
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            (Err(e), _) => {
                                // Kept and failed on below; the call is retried so the run
                                // still ends with a full picture.
                                stats.errors.push(format!("{:?}: {e}", e.kind()));
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                        }
                    }
                }
                stats
            });
        }
        let mut all = StormStats::default();
        for stats in tasks.join_all().await {
            all.answers.extend(stats.answers);
            all.cancelled += stats.cancelled;
            all.in_flight += stats.in_flight;
            all.errors.extend(stats.errors);
        }
        assert!(
            all.errors.is_empty(),
            "{}: unexpected errors: {:?}",
            b.name,
            all.errors
        );
        assert_eq!(all.answers.len(), calls, "{}: every call answered", b.name);
        let recorded = recorded_answers(&b.db, &run).await;
        let mut executed = 0;
        for (k, answer, outcome) in &all.answers {
            let key = key_of(&run, *k);
            assert_eq!(
                Some(answer),
                recorded.get(&key),
                "{}: every answer for {key} is the recorded one",
                b.name
            );
            executed += usize::from(*outcome == Some(Outcome::Executed));
        }
        // A call cancelled after its commit executed without anyone seeing `Executed`.
        assert!(executed <= keys, "{}: {executed} Executed outcomes", b.name);
        let s = assert_exactly_once(&b, &run, keys, "R1").await;
        eprintln!(
            "R1 {}: {calls} calls over {keys} keys from {tasks_n} tasks: {} executions, \
             {} duplicates, {} effect rows, pending {}, {} impatient calls cancelled, \
             {} in-flight retries, {:.1?}",
            b.name,
            s.executions,
            s.executions - keys as i64,
            s.effects,
            s.pending,
            all.cancelled,
            all.in_flight,
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// R2 many processes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_four_processes_execute_each_key_once() {
    const PROCESSES: usize = 4;
    const KEYS: usize = 500;
    for b in backends(4).await {
        let started = Instant::now();
        let run = unique("r2");
        let mut rng = Rng::new("r2");
        let seeds: Vec<u64> = (0..PROCESSES).map(|_| rng.next_u64()).collect();
        let (url, run2) = (b.url.clone(), run.clone());
        let lines = tokio::task::spawn_blocking(move || {
            let mut children: Vec<_> = seeds
                .iter()
                .map(|seed| {
                    spawn_child(&[
                        ("IDEM_REL_MODE", "worker".into()),
                        ("IDEM_REL_URL", url.clone()),
                        ("IDEM_REL_RUN", run2.clone()),
                        ("IDEM_REL_KEYS", KEYS.to_string()),
                        ("IDEM_REL_SEED", seed.to_string()),
                        ("IDEM_REL_CONCURRENCY", "8".into()),
                        ("IDEM_REL_WAIT_GO", "1".into()),
                    ])
                })
                .collect();
            for child in &mut children {
                assert!(
                    child.wait_for("READY", Duration::from_secs(60)).is_some(),
                    "a worker never got ready: {:?}",
                    child.seen
                );
            }
            // All four start together.
            for child in &mut children {
                child.send("GO");
            }
            children
                .into_iter()
                .map(|child| {
                    let done = child.finish(Duration::from_secs(600));
                    assert!(done.status.success(), "worker failed: {}", done.stderr);
                    done.lines
                })
                .collect::<Vec<_>>()
        })
        .await
        .expect("the workers");
        let mut by_key: BTreeMap<String, Vec<(String, Answer)>> = BTreeMap::new();
        let mut in_flight = 0;
        for process in &lines {
            let errors: Vec<_> = process.iter().filter(|l| l.starts_with("ERROR")).collect();
            assert!(errors.is_empty(), "{}: worker errors: {errors:?}", b.name);
            assert!(
                process.iter().any(|l| l.starts_with("DONE")),
                "{}: a worker did not finish",
                b.name
            );
            in_flight += process
                .iter()
                .filter_map(|l| l.strip_prefix("DONE in_flight="))
                .map(|n| n.parse::<u64>().expect("count"))
                .sum::<u64>();
            for (key, outcome, answer) in answers(process) {
                by_key.entry(key).or_default().push((outcome, answer));
            }
        }
        assert_eq!(by_key.len(), KEYS, "{}: every key answered", b.name);
        let recorded = recorded_answers(&b.db, &run).await;
        let mut executed = 0;
        for (key, got) in &by_key {
            assert_eq!(
                got.len(),
                PROCESSES,
                "{}: {key} answered in every process",
                b.name
            );
            for (outcome, answer) in got {
                assert_eq!(Some(answer), recorded.get(key), "{}: {key}", b.name);
                executed += usize::from(outcome == "Executed");
            }
        }
        assert_eq!(executed, KEYS, "{}: one Executed outcome per key", b.name);
        let s = assert_exactly_once(&b, &run, KEYS, "R2").await;
        eprintln!(
            "R2 {}: {PROCESSES} processes x {KEYS} keys ({} calls): {} executions, {} effect \
             rows, pending {}, {in_flight} in-flight retries, {:.1?}",
            b.name,
            PROCESSES * KEYS,
            s.executions,
            s.effects,
            s.pending,
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// R3 crash

/// Where R3 kills a child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillAt {
    /// The child sleeps at this named point; killed while there.
    Point(&'static str),
    /// Killed 0..4 ms after the body returned: somewhere in record / commit / reply.
    CommitRace,
    /// Killed at a uniformly random time after spawn, anywhere in the run.
    RandomTime,
}

impl KillAt {
    fn name(self) -> &'static str {
        match self {
            Self::Point(p) => p,
            Self::CommitRace => "commit-race",
            Self::RandomTime => "random-time",
        }
    }
}

const NAMED_POINTS: [&str; 5] = [
    "before-claim",
    "after-claim",
    "mid-body",
    "before-commit",
    "after-commit",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_sigkill_at_random_points_loses_and_duplicates_nothing() {
    let kills = if quick() { 40 } else { 100 };
    for b in backends(4).await {
        let started = Instant::now();
        let run = unique("r3");
        let mut rng = Rng::new("r3");
        // 15 % at each named point (sleeping there), 15 % racing the commit, 10 % at a
        // random time; shuffled.
        let mut plan: Vec<KillAt> = (0..kills)
            .map(|i| match i * 20 / kills {
                0..=14 => KillAt::Point(NAMED_POINTS[i * 20 / kills / 3]),
                15..=17 => KillAt::CommitRace,
                _ => KillAt::RandomTime,
            })
            .collect();
        rng.shuffle(&mut plan);
        let mut last_run = Duration::from_millis(50);
        // How long record + commit + reply take (from the body's end to the answer), as
        // measured on the retries: the commit race kills uniformly within twice that.
        let mut commit_window = Duration::from_millis(4);
        let mut tally: BTreeMap<String, (u32, u32)> = BTreeMap::new();
        let mut retry_times = Vec::new();
        let mut reached_tally: BTreeMap<String, u32> = BTreeMap::new();
        for (i, kill) in plan.iter().copied().enumerate() {
            let c = cmd(&run, i);
            let env = |stop_at: &str, sleep_ms: u64| {
                vec![
                    ("IDEM_REL_MODE", "crash".to_owned()),
                    ("IDEM_REL_URL", b.url.clone()),
                    ("IDEM_REL_RUN", run.clone()),
                    ("IDEM_REL_KEY", c.key.clone()),
                    ("IDEM_REL_AMOUNT", c.amount.to_string()),
                    ("IDEM_REL_STOP_AT", stop_at.to_owned()),
                    ("IDEM_REL_SLEEP_MS", sleep_ms.to_string()),
                ]
            };
            let (stop_at, sleep_ms) = match kill {
                KillAt::Point(p) => (p, 60_000),
                KillAt::CommitRace => ("before-commit", 0),
                KillAt::RandomTime => ("none", 0),
            };
            let jitter_us = match kill {
                KillAt::Point(_) => rng.below(2_000),
                KillAt::CommitRace => rng.below(2 * commit_window.as_micros() as u64 + 1),
                KillAt::RandomTime => rng.below(last_run.as_micros() as u64 + 1),
            };
            let env_first = env(stop_at, sleep_ms);
            let (first, exited_before_kill) = tokio::task::spawn_blocking(move || {
                let mut child = spawn_child(&env_first);
                let marker = match kill {
                    KillAt::Point(p) => Some(format!("AT {p}")),
                    KillAt::CommitRace => Some("AT before-commit".to_owned()),
                    KillAt::RandomTime => None,
                };
                if let Some(marker) = marker {
                    assert!(
                        child.wait_for(&marker, Duration::from_secs(30)).is_some(),
                        "{kill:?}: the child never reached {marker}: {:?}",
                        child.seen
                    );
                }
                std::thread::sleep(Duration::from_micros(jitter_us));
                child.kill()
            })
            .await
            .expect("the first child");
            let first_answer = answers(&first).into_iter().next();
            let reached = if exited_before_kill {
                "exit".to_owned()
            } else {
                first
                    .iter()
                    .rev()
                    .find(|l| l.starts_with("AT ") || l.starts_with("ANSWER") || *l == "START")
                    .map(|l| l.split(' ').take(2).collect::<Vec<_>>().join(" "))
                    .unwrap_or_else(|| "spawn".into())
            };
            *reached_tally.entry(reached.clone()).or_default() += 1;

            // Right after the kill: no pending row, and the effects agree with the ledger.
            let s = snapshot(&b.db, SCOPE, &run, Some(&c.key)).await;
            assert_eq!(s.pending, 0, "{} {kill:?}: a key left claimed", b.name);
            assert_eq!(s.other, 0, "{} {kill:?}", b.name);
            assert!(s.completed <= 1, "{} {kill:?}: {s:?}", b.name);
            assert_eq!(
                (s.effects, s.executions),
                (2 * s.completed, s.completed),
                "{} {kill:?} (last seen: {reached}): effects must be all or nothing: {s:?}",
                b.name
            );
            match kill {
                KillAt::Point("after-commit") => {
                    assert_eq!(s.completed, 1, "{}: committed before the kill", b.name);
                    let (_, outcome, answer) = first_answer.clone().expect("an answer");
                    assert_eq!(outcome, "Executed");
                    assert_eq!(
                        recorded_answer(&b.db, &c.key).await.as_ref(),
                        Some(&answer),
                        "{}: the committed result is the one the killed run returned",
                        b.name
                    );
                }
                KillAt::Point(p) => assert_eq!(
                    s.completed, 0,
                    "{}: killed at {p}, nothing may be committed",
                    b.name
                ),
                _ => {}
            }
            let entry = tally.entry(kill.name().to_owned()).or_default();
            entry.0 += 1;
            entry.1 += s.completed as u32;

            // A fresh process retries the same key to completion.
            let env_retry = env("none", 0);
            let retry_started = Instant::now();
            let done = tokio::task::spawn_blocking(move || {
                spawn_child(&env_retry).finish(Duration::from_secs(60))
            })
            .await
            .expect("the retry");
            last_run = retry_started.elapsed();
            retry_times.push(last_run);
            assert!(
                done.status.success(),
                "{}: retry failed: {}",
                b.name,
                done.stderr
            );
            if let Some(window) = done.between("AT before-commit", "ANSWER") {
                commit_window = window;
            }
            let retry = done.lines;
            let (_, outcome, answer) = answers(&retry).into_iter().next().unwrap_or_else(|| {
                panic!("{} {kill:?}: the retry did not answer: {retry:?}", b.name)
            });
            if s.completed == 1 {
                assert_eq!(outcome, "Replayed", "{} {kill:?}", b.name);
            }
            if let Some((_, _, first)) = &first_answer {
                assert_eq!(
                    &answer, first,
                    "{} {kill:?}: no committed result lost",
                    b.name
                );
            }
            assert_eq!(
                recorded_answer(&b.db, &c.key).await.as_ref(),
                Some(&answer),
                "{}: the retry's answer is the recorded one",
                b.name
            );
            let s = snapshot(&b.db, SCOPE, &run, Some(&c.key)).await;
            assert_eq!(
                s,
                Snapshot {
                    effects: 2,
                    executions: 1,
                    pending: 0,
                    completed: 1,
                    other: 0
                },
                "{} {kill:?}: exactly one execution after the retry",
                b.name
            );
        }

        // One more process replays every key: nothing executes again.
        let (url, run2) = (b.url.clone(), run.clone());
        let replay = tokio::task::spawn_blocking(move || {
            spawn_child(&[
                ("IDEM_REL_MODE", "worker".into()),
                ("IDEM_REL_URL", url),
                ("IDEM_REL_RUN", run2),
                ("IDEM_REL_KEYS", kills.to_string()),
                ("IDEM_REL_SEED", "1".into()),
                ("IDEM_REL_CONCURRENCY", "4".into()),
                ("IDEM_REL_WAIT_GO", "0".into()),
            ])
            .finish(Duration::from_secs(120))
        })
        .await
        .expect("the replay");
        assert!(
            replay.status.success(),
            "{}: replay failed: {}",
            b.name,
            replay.stderr
        );
        let recorded = recorded_answers(&b.db, &run).await;
        let replayed = answers(&replay.lines);
        assert_eq!(replayed.len(), kills, "{}", b.name);
        for (key, outcome, answer) in replayed {
            assert_eq!(outcome, "Replayed", "{}: {key}", b.name);
            assert_eq!(Some(&answer), recorded.get(&key), "{}: {key}", b.name);
        }
        let s = assert_exactly_once(&b, &run, kills, "R3").await;
        retry_times.sort();
        eprintln!(
            "R3 {}: {kills} SIGKILLs, then a retry each: {} executions, {} effect rows, \
             pending {}; kills (count, committed before the kill): {tally:?}; last point \
             the child reported before the kill: {reached_tally:?}; retry median {:.0?}; \
             commit window {commit_window:.1?}; {:.1?}",
            b.name,
            s.executions,
            s.effects,
            s.pending,
            retry_times[retry_times.len() / 2],
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// R4 cancellation

struct Signal(tokio::sync::Notify);

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify_one();
    }
}

/// Polls `future` up to `n` times, each time after it asked to be woken, then drops it.
/// `Ok(Some(output))` if it finished within `n` polls.
async fn poll_then_drop<F: Future>(future: F, n: usize) -> Result<Option<F::Output>, String> {
    let signal = Arc::new(Signal(tokio::sync::Notify::new()));
    let waker = Waker::from(Arc::clone(&signal));
    let mut future = pin!(future);
    for poll in 1..=n {
        if let Poll::Ready(output) = future.as_mut().poll(&mut Context::from_waker(&waker)) {
            return Ok(Some(output));
        }
        if poll < n
            && tokio::time::timeout(Duration::from_secs(10), signal.0.notified())
                .await
                .is_err()
        {
            return Err(format!("never woken after poll {poll}"));
        }
    }
    Ok(None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_dropping_the_future_after_any_poll_leaves_nothing_behind() {
    for b in backends(4).await {
        let started = Instant::now();
        // The calls run on a pool of their own; every count is read on `b.db`, so what is
        // checked is the database, whatever state the calls leave their connections in.
        let pool = connect(&b.url, 4).await;
        for probe in [Probe::Quiet, Probe::Yield] {
            let run = unique("r4");
            let mut committed_when_dropped = Vec::new();
            let mut n = 0;
            let polls_to_finish = loop {
                n += 1;
                assert!(n < 2_000, "{}: the call never finished", b.name);
                let c = cmd(&run, n);
                let dropped = poll_then_drop(transfer(&pool, c.clone(), &probe), n).await;
                let finished = match dropped {
                    Ok(Some(result)) => Some(result.expect("a call polled to the end")),
                    Ok(None) => None,
                    Err(e) => panic!("{} N={n}: {e}", b.name),
                };
                let s = snapshot(&b.db, SCOPE, &run, Some(&c.key)).await;
                assert_eq!(s.pending, 0, "{} N={n}: a stuck claim", b.name);
                assert_eq!(
                    (s.effects, s.executions),
                    (2 * s.completed, s.completed),
                    "{} N={n}: a partial write: {s:?}",
                    b.name
                );
                if finished.is_none() && s.completed == 1 {
                    committed_when_dropped.push(n);
                }
                let (retried, outcome) =
                    with_outcome(transfer(&pool, c.clone(), &Probe::Quiet)).await;
                let retried = retried.unwrap_or_else(|e| panic!("{} N={n}: retry: {e}", b.name));
                if finished.is_some() || s.completed == 1 {
                    assert_eq!(outcome, Some(Outcome::Replayed), "{} N={n}", b.name);
                }
                if let Some(first) = &finished {
                    assert_eq!(first, &retried, "{} N={n}", b.name);
                }
                assert_eq!(
                    recorded_answer(&b.db, &c.key).await.as_ref(),
                    Some(&retried),
                    "{} N={n}",
                    b.name
                );
                let s = snapshot(&b.db, SCOPE, &run, Some(&c.key)).await;
                assert_eq!(
                    (s.effects, s.executions, s.completed, s.pending),
                    (2, 1, 1, 0),
                    "{} N={n}: the retry executes exactly once",
                    b.name
                );
                if finished.is_some() {
                    break n;
                }
            };
            // The replay path: dropping it after any poll changes nothing.
            let key = key_of(&run, polls_to_finish);
            let before = ledger_row(&b.db, SCOPE, &key).await;
            let c = cmd(&run, polls_to_finish);
            let mut replay_polls = 0;
            for n in 1.. {
                let dropped = poll_then_drop(transfer(&pool, c.clone(), &Probe::Quiet), n)
                    .await
                    .unwrap_or_else(|e| panic!("{} replay N={n}: {e}", b.name));
                assert_eq!(ledger_row(&b.db, SCOPE, &key).await, before, "{}", b.name);
                if let Some(result) = dropped {
                    assert_eq!(
                        Some(result.expect("replay")),
                        recorded_answer(&b.db, &key).await
                    );
                    replay_polls = n;
                    break;
                }
            }
            let s = assert_exactly_once(&b, &run, polls_to_finish, "R4").await;
            eprintln!(
                "R4 {} ({probe:?}): dropped after N = 1..{} polls (a call needs {polls_to_finish}; \
                 a replay {replay_polls}); dropped after commit at N = {committed_when_dropped:?}; \
                 {} executions for {polls_to_finish} keys, {} effect rows, pending {}; {:.1?}",
                b.name,
                polls_to_finish - 1,
                s.executions,
                s.effects,
                s.pending,
                started.elapsed()
            );
        }
    }
}

/// Whether the one connection of `pool` is back in the pool and outside any transaction, as
/// the server sees it (SQLite: back in the pool). Bounded: a connection that never came back
/// is an `Err` instead of a hang.
async fn pool_connection_state(
    b: &Backend,
    pool: &DatabaseConnection,
    other: &DatabaseConnection,
    pid: i64,
) -> Result<bool, String> {
    let (db, sql, values) = match b.name {
        "mysql" => (pool, "SELECT CAST(@@in_transaction AS SIGNED)", vec![]),
        "postgres" => (
            other,
            "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ? \
             AND state LIKE 'idle in transaction%'",
            vec![pid.into()],
        ),
        _ => (pool, "SELECT 0", vec![]),
    };
    // idem finishes its own ledger steps on a task of their own after the caller stops
    // waiting, so the connection may legitimately be in use for a moment: a leak is a
    // transaction that is still open once the pool is quiet (up to 5 s).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if b.name == "postgres" {
            // The check reads another connection: first make sure this one came back (its
            // next use also flushes a rollback that sqlx queued when the transaction dropped).
            tokio::time::timeout(Duration::from_secs(10), pool.execute_unprepared("SELECT 1"))
                .await
                .map_err(|_| "the connection never came back to the pool".to_owned())?
                .map_err(|e| format!("the connection is unusable: {e}"))?;
        }
        let row = tokio::time::timeout(
            Duration::from_secs(10),
            db.query_one_raw(stmt(db, sql, values.clone())),
        )
        .await
        .map_err(|_| "the connection never came back to the pool".to_owned())?
        .map_err(|e| format!("the connection is unusable: {e}"))?
        .expect("a row");
        let in_transaction = row.try_get_by_index::<i64>(0).expect("a flag") != 0;
        if !in_transaction || Instant::now() > deadline {
            return Ok(in_transaction);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A handler whose body runs no statement: every point a call can be dropped at is in idem's
/// own ledger steps.
#[idempotent(scope = "rel.claim-only", key = cmd.key, skip(probe))]
async fn claim_only(
    db: &DatabaseConnection,
    cmd: Transfer,
    probe: &Probe,
) -> Result<Answer, idem::Error> {
    let _ = db;
    probe.at("after-claim").await;
    Ok(Answer {
        key: cmd.key,
        amount: cmd.amount,
        execution: unique("exec"),
    })
}

/// A call dropped at any point of idem's own steps (begin, claim, record, release) must leave
/// its pooled connection clean: back in the pool and outside any transaction. Otherwise the
/// next borrower runs inside the stale transaction (stale reads under REPEATABLE READ,
/// autocommit writes that are not committed, locks held), or the pool shrinks for good.
///
/// With sqlx 0.9.0 a future dropped while a `BEGIN` is in flight leaves PostgreSQL idle in
/// transaction, and on MariaDB one dropped mid-prepare never returns its connection
/// (docs/RELIABILITY.md, "Findings"); idem therefore runs each ledger step on a task of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_dropped_calls_leave_the_pooled_connection_clean() {
    dropped_calls_leave_the_pool_clean(false).await;
}

/// The same for a body that runs its own statements when it is dropped: idem cannot finish
/// the handler's statements for it, so this exposes the sqlx 0.9.0 cancellation bugs above in
/// user code. Kept as a regression probe for the sqlx upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "sqlx 0.9.0 cancellation bugs in the handler's own statements: docs/RELIABILITY.md, finding 2"]
async fn r4_dropped_bodies_mid_statement_leave_the_pooled_connection_clean() {
    dropped_calls_leave_the_pool_clean(true).await;
}

async fn dropped_calls_leave_the_pool_clean(body_statements: bool) {
    let rounds = if quick() { 20 } else { 60 };
    let mut failures = Vec::new();
    for b in backends(4).await {
        let started = Instant::now();
        // One connection, so every check sees the connection the dropped call used.
        let pool = connect(&b.url, 1).await;
        let other = connect(&b.url, 1).await;
        let pid: i64 = match b.name {
            "postgres" => pool
                .query_one_raw(stmt(
                    &pool,
                    "SELECT CAST(pg_backend_pid() AS BIGINT)",
                    vec![],
                ))
                .await
                .expect("pid")
                .expect("a row")
                .try_get_by_index(0)
                .expect("pid"),
            _ => 0,
        };
        let run = unique("r4tx");
        let mut drops = 0;
        let mut leaked = Vec::new();
        let mut lost = None;
        'rounds: for round in 0..rounds {
            for n in 1..=4 {
                let c = cmd(&run, round * 10 + n);
                let probe = if round % 2 == 0 {
                    Probe::Quiet
                } else {
                    Probe::Yield
                };
                let finished = if body_statements {
                    poll_then_drop(transfer(&pool, c, &probe), n).await
                } else {
                    poll_then_drop(claim_only(&pool, c, &probe), n).await
                }
                .unwrap_or_else(|e| panic!("{} N={n}: {e}", b.name));
                if finished.is_some() {
                    break;
                }
                drops += 1;
                match pool_connection_state(&b, &pool, &other, pid).await {
                    Ok(false) => {}
                    Ok(true) => {
                        leaked.push(format!("round {round} ({probe:?}) N={n}"));
                        // End it, so the rest of the run measures the next drop alone.
                        pool.execute_unprepared("ROLLBACK").await.expect("rollback");
                    }
                    Err(e) => {
                        lost = Some(format!("round {round} ({probe:?}) N={n}: {e}"));
                        break 'rounds;
                    }
                }
            }
        }
        let report = format!(
            "{}: {drops} calls dropped after 1..4 polls on a one-connection pool: {} left it \
             inside a transaction {leaked:?}; connection lost: {lost:?}",
            b.name,
            leaked.len(),
        );
        eprintln!("R4 {report}; {:.1?}", started.elapsed());
        if !leaked.is_empty() || lost.is_some() {
            failures.push(report);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

static SHORT_WAIT: idem_core::engine::Site = idem_core::engine::Site::new(
    "rel.short-wait",
    Duration::from_secs(3600),
    idem::store::Concurrency::Wait {
        bound: Duration::from_millis(300),
    },
);

/// `transfer`, on the engine API with a wait bound of 300 ms (the attribute's is 5 s), whose
/// body holds the claim for `hold`.
async fn short_wait(
    db: &DatabaseConnection,
    c: &Transfer,
    hold: Duration,
) -> Result<Answer, idem::Error> {
    let mut call = idem_core::engine::Call::new(
        &SHORT_WAIT,
        idem::sea_orm::SeaOrmStore::new(db),
        idem::Key::new(c.key.as_str()),
    );
    call.arg(c);
    let guard = match call.claim::<Result<Answer, idem::Error>>(None).await {
        Ok(guard) => guard,
        Err(answer) => return answer,
    };
    let execution = unique("exec");
    let output = async {
        effect(guard.tx(), &c.run, &c.key, "debit", &execution).await?;
        tokio::time::sleep(hold).await;
        effect(guard.tx(), &c.run, &c.key, "credit", &execution).await?;
        Ok(Answer {
            key: c.key.clone(),
            amount: c.amount,
            execution: execution.clone(),
        })
    }
    .await;
    guard.finish(output).await
}

/// The engine itself drops a duplicate's claim when its wait bound passes (the duplicate
/// is blocked in the claim's locking statement). That must cost nothing: the duplicate's
/// pooled connection comes back usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_duplicates_cut_off_by_the_wait_bound_return_their_connections() {
    const DUPLICATES: usize = 6;
    for b in backends(4).await {
        let started = Instant::now();
        // SQLite's pool has one connection (SeaORM's default): the duplicates wait for it.
        let size: u32 = if b.name == "sqlite" { 1 } else { 3 };
        let pool = connect(&b.url, size).await;
        let run = unique("r4wait");
        let c = cmd(&run, 0);
        let first = {
            let (pool, c) = (pool.clone(), c.clone());
            tokio::spawn(async move { short_wait(&pool, &c, Duration::from_millis(2_500)).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut in_flight = 0;
        for _ in 0..DUPLICATES {
            match short_wait(&pool, &c, Duration::ZERO).await {
                Err(e) if e.kind() == ErrorKind::InFlight => in_flight += 1,
                other => panic!("{}: a duplicate during the first call: {other:?}", b.name),
            }
        }
        let answer = first.await.expect("join").expect("the first call");
        assert_eq!(
            short_wait(&pool, &c, Duration::ZERO).await.expect("replay"),
            answer
        );
        // Every connection of the pool is usable again: as many transactions at once.
        let all = async {
            let mut open = Vec::new();
            for _ in 0..size {
                let tx = sea_orm::TransactionTrait::begin(&pool).await?;
                tx.query_one_raw(stmt(&tx, "SELECT 1", vec![])).await?;
                open.push(tx);
            }
            Ok::<_, sea_orm::DbErr>(open.len())
        };
        let usable = tokio::time::timeout(Duration::from_secs(10), all).await;
        eprintln!(
            "R4 {}: {in_flight} duplicates cut off by a 300 ms wait bound; afterwards the \
             {size}-connection pool gives {usable:?} transactions at once; {:.1?}",
            b.name,
            started.elapsed()
        );
        assert!(
            matches!(usable, Ok(Ok(n)) if n == size as usize),
            "{}: after {in_flight} duplicates were cut off by the wait bound, the pool cannot \
             give {size} connections: {usable:?}",
            b.name
        );
        let s = snapshot(&b.db, "rel.short-wait", &run, None).await;
        assert_eq!(
            (s.effects, s.executions, s.completed, s.pending),
            (2, 1, 1, 0),
            "{}",
            b.name
        );
    }
}

#[idempotent(scope = "rel.outcome", key = key, skip(pause))]
async fn paused(db: &DatabaseConnection, key: String, pause: Duration) -> Result<u8, idem::Error> {
    let _ = db;
    tokio::time::sleep(pause).await;
    Ok(7)
}

/// A call cancelled inside its body must not hide how a later call in the same
/// `with_outcome` scope was answered (the HTTP adapter's replay header depends on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_a_cancelled_call_does_not_hide_the_next_outcome() {
    for b in backends(4).await {
        let (recorded, fresh) = (unique("outcome"), unique("outcome"));
        paused(&b.db, recorded.clone(), Duration::ZERO)
            .await
            .expect("record");
        let (answer, outcome) = with_outcome(async {
            let cancelled = tokio::time::timeout(
                Duration::from_millis(50),
                paused(&b.db, fresh.clone(), Duration::from_secs(30)),
            )
            .await;
            assert!(cancelled.is_err(), "cut off inside its body");
            paused(&b.db, recorded.clone(), Duration::ZERO).await
        })
        .await;
        assert_eq!(answer.expect("replay"), 7);
        assert_eq!(
            outcome,
            Some(Outcome::Replayed),
            "{}: the replay after a cancelled call is reported",
            b.name
        );
        let (_, outcome) = with_outcome(async {
            let _ = tokio::time::timeout(
                Duration::from_millis(50),
                paused(&b.db, fresh.clone(), Duration::from_secs(30)),
            )
            .await;
            paused(&b.db, fresh.clone(), Duration::ZERO).await
        })
        .await;
        assert_eq!(
            outcome,
            Some(Outcome::Executed),
            "{}: the execution after a cancelled call is reported",
            b.name
        );
    }
}

// ---------------------------------------------------------------------------------------
// R5 database faults

/// What R5 breaks, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FaultAt {
    /// The handler's connection is killed after the claim, before the body's writes.
    BeforeWrites,
    /// The handler's connection is killed after the body's writes, before the record.
    BeforeRecord,
}

struct Fault {
    at: Option<FaultAt>,
    /// Another connection, to kill the handler's with.
    killer: DatabaseConnection,
}

impl Fault {
    /// Kills the server connection `tx` runs on, from the other connection, and waits until
    /// the server has dropped it.
    async fn strike<C: ConnectionTrait>(&self, tx: &C) {
        let (me, kill, gone) = match tx.get_database_backend() {
            sea_orm::DbBackend::Postgres => (
                "SELECT CAST(pg_backend_pid() AS BIGINT)",
                "SELECT pg_terminate_backend(CAST(? AS INTEGER))",
                "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?",
            ),
            _ => (
                "SELECT CAST(CONNECTION_ID() AS SIGNED)",
                "KILL CONNECTION ?",
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
            ),
        };
        let id: i64 = tx
            .query_one_raw(stmt(tx, me, vec![]))
            .await
            .expect("own connection id")
            .expect("a row")
            .try_get_by_index(0)
            .expect("an id");
        kill_connection(&self.killer, kill, gone, id).await;
    }
}

async fn kill_connection(killer: &DatabaseConnection, kill: &str, gone: &str, id: i64) {
    let kill = if killer.get_database_backend() == sea_orm::DbBackend::MySql {
        // KILL takes no placeholder.
        kill.replace('?', &id.to_string())
    } else {
        kill.to_owned()
    };
    let values = if kill.contains('?') {
        vec![id.into()]
    } else {
        vec![]
    };
    killer
        .execute_raw(stmt(killer, &kill, values))
        .await
        .expect("kill the connection");
    for _ in 0..500 {
        let left: i64 = killer
            .query_one_raw(stmt(killer, gone, vec![id.into()]))
            .await
            .expect("is it gone")
            .expect("a row")
            .try_get_by_index(0)
            .expect("a count");
        if left == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("connection {id} survived its kill");
}

#[idempotent(scope = "rel.fault", key = cmd.key, skip(fault))]
async fn faulty(
    db: &DatabaseConnection,
    cmd: Transfer,
    fault: &Fault,
) -> Result<Answer, idem::Error> {
    if fault.at == Some(FaultAt::BeforeWrites) {
        fault.strike(db).await;
    }
    let execution = unique("exec");
    effect(db, &cmd.run, &cmd.key, "debit", &execution).await?;
    effect(db, &cmd.run, &cmd.key, "credit", &execution).await?;
    if fault.at == Some(FaultAt::BeforeRecord) {
        fault.strike(db).await;
    }
    Ok(Answer {
        key: cmd.key,
        amount: cmd.amount,
        execution,
    })
}

/// Runs `faulty` in a task of its own, so a panic is reported as such.
async fn run_faulty(
    db: &DatabaseConnection,
    c: &Transfer,
    fault: Fault,
) -> Result<(Result<Answer, idem::Error>, Option<Outcome>), String> {
    let (db, c) = (db.clone(), c.clone());
    tokio::spawn(async move { with_outcome(faulty(&db, c, &fault)).await })
        .await
        .map_err(|e| format!("the call panicked: {e}"))
}

/// After a fault: a typed store error, nothing half-written; the retry executes exactly once.
async fn after_fault(
    b: &Backend,
    retry_db: &DatabaseConnection,
    killer: &DatabaseConnection,
    run: &str,
    c: &Transfer,
    what: &str,
    result: Result<(Result<Answer, idem::Error>, Option<Outcome>), String>,
) -> String {
    let (result, _) = result.unwrap_or_else(|e| panic!("{} {what}: {e}", b.name));
    let err = match result {
        Ok(a) => panic!("{} {what}: succeeded despite the fault: {a:?}", b.name),
        Err(e) => e,
    };
    assert_eq!(err.kind(), ErrorKind::Store, "{} {what}: {err}", b.name);
    let s = snapshot(&b.db, "rel.fault", run, Some(&c.key)).await;
    assert_eq!(
        s,
        Snapshot::default(),
        "{} {what}: nothing half-written",
        b.name
    );
    let retry = run_faulty(
        retry_db,
        c,
        Fault {
            at: None,
            killer: killer.clone(),
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{} {what}: retry: {e}", b.name));
    let (answer, outcome) = (
        retry
            .0
            .unwrap_or_else(|e| panic!("{} {what}: retry: {e}", b.name)),
        retry.1,
    );
    assert_eq!(outcome, Some(Outcome::Executed), "{} {what}", b.name);
    let again = faulty(
        retry_db,
        c.clone(),
        &Fault {
            at: None,
            killer: killer.clone(),
        },
    )
    .await
    .expect("replay");
    assert_eq!(again, answer, "{} {what}: replayed", b.name);
    let s = snapshot(&b.db, "rel.fault", run, Some(&c.key)).await;
    assert_eq!(
        (s.effects, s.executions, s.completed, s.pending),
        (2, 1, 1, 0),
        "{} {what}: the retry executed exactly once",
        b.name
    );
    format!("{what}: {err}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r5_a_broken_connection_is_a_store_error_and_the_retry_succeeds_once() {
    for b in backends(4).await {
        let started = Instant::now();
        let run = unique("r5");
        let mut seen = Vec::new();
        let killer = connect(&b.url, 2).await;
        if b.name != "sqlite" {
            // The handler's pool has ONE connection: the retry must not get the dead one.
            let db = connect(&b.url, 1).await;
            for (i, at) in [FaultAt::BeforeWrites, FaultAt::BeforeRecord]
                .into_iter()
                .enumerate()
            {
                let c = cmd(&run, i);
                let result = run_faulty(
                    &db,
                    &c,
                    Fault {
                        at: Some(at),
                        killer: killer.clone(),
                    },
                )
                .await;
                seen.push(
                    after_fault(&b, &db, &killer, &run, &c, &format!("{at:?}"), result).await,
                );
            }

            // Killed while its claim waits for the key's row lock, held by another
            // transaction with an uncommitted ledger row of the same id. The handler's pool
            // has one connection: its id is the claim's.
            let c = cmd(&run, 2);
            let postgres = b.name == "postgres";
            let (own_id, waits, kill, gone) = if postgres {
                (
                    "SELECT CAST(pg_backend_pid() AS BIGINT)",
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ? \
                     AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO idem_ledger%'",
                    "SELECT pg_terminate_backend(CAST(? AS INTEGER))",
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ?",
                )
            } else {
                (
                    "SELECT CAST(CONNECTION_ID() AS SIGNED)",
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? \
                     AND INFO LIKE 'INSERT INTO idem_ledger%'",
                    "KILL CONNECTION ?",
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
                )
            };
            let claimer: i64 = db
                .query_one_raw(stmt(&db, own_id, vec![]))
                .await
                .expect("the pool's connection id")
                .expect("a row")
                .try_get_by_index(0)
                .expect("an id");
            let blocker = sea_orm::TransactionTrait::begin(&killer)
                .await
                .expect("begin");
            blocker
                .execute_raw(stmt(
                    &blocker,
                    "INSERT INTO idem_ledger (id, scope, principal, idem_key, owner, fingerprint, \
                     state, response, created_at_ms, expires_at_ms) \
                     VALUES (?, 'rel.fault', '', ?, 1, ?, 0, NULL, 0, 9000000000000)",
                    vec![
                        idem::store::record_id("rel.fault", "", &c.key)
                            .to_vec()
                            .into(),
                        c.key.clone().into(),
                        vec![0_u8; 32].into(),
                    ],
                ))
                .await
                .expect("the blocking row");
            let call = {
                let (db, c, killer) = (db.clone(), c.clone(), killer.clone());
                tokio::spawn(async move {
                    with_outcome(faulty(&db, c, &Fault { at: None, killer })).await
                })
            };
            let mut waiting = false;
            for _ in 0..300 {
                let n: i64 = killer
                    .query_one_raw(stmt(&killer, waits, vec![claimer.into()]))
                    .await
                    .expect("is the claim waiting")
                    .expect("a row")
                    .try_get_by_index(0)
                    .expect("a count");
                if n == 1 {
                    waiting = true;
                    break;
                }
                assert!(!call.is_finished(), "{}: the claim did not wait", b.name);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(
                waiting,
                "{}: the claim never waited on connection {claimer}",
                b.name
            );
            kill_connection(&killer, kill, gone, claimer).await;
            let result = call.await.map_err(|e| format!("the call panicked: {e}"));
            blocker.rollback().await.expect("release the blocking row");
            seen.push(after_fault(&b, &db, &killer, &run, &c, "WhileClaiming", result).await);
        }

        // The pool is closed under the caller (the database is unreachable).
        let c = cmd(&run, 3);
        let closed = connect(&b.url, 1).await;
        closed.close_by_ref().await.expect("close");
        let result = run_faulty(
            &closed,
            &c,
            Fault {
                at: None,
                killer: killer.clone(),
            },
        )
        .await;
        let fresh = connect(&b.url, 1).await;
        seen.push(after_fault(&b, &fresh, &killer, &run, &c, "PoolClosed", result).await);
        eprintln!(
            "R5 {}: {} faults, each a Store error, nothing written, one execution on retry: \
             {seen:#?}; {:.1?}",
            b.name,
            seen.len(),
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// R6 bad input

#[derive(Debug, Clone, Serialize, Deserialize)]
struct BadCmd {
    key: String,
    run: String,
    amount: i64,
    note: Option<String>,
}

impl BadCmd {
    fn new(run: &str, key: &str) -> Self {
        Self {
            key: key.to_owned(),
            run: run.to_owned(),
            amount: 100,
            note: None,
        }
    }
}

async fn bad_effect<C: ConnectionTrait>(db: &C, cmd: &BadCmd) -> Result<Answer, idem::Error> {
    let execution = unique("exec");
    effect(db, &cmd.run, &cmd.key, "debit", &execution).await?;
    effect(db, &cmd.run, &cmd.key, "credit", &execution).await?;
    Ok(Answer {
        key: cmd.key.clone(),
        amount: cmd.amount,
        execution,
    })
}

#[idempotent(scope = "rel.bad", key = cmd.key)]
async fn bad_pay(db: &DatabaseConnection, cmd: BadCmd) -> Result<Answer, idem::Error> {
    bad_effect(db, &cmd).await
}

#[idempotent(scope = "rel.bad.bytes", key = raw, skip(cmd))]
async fn bad_bytes(
    db: &DatabaseConnection,
    raw: Vec<u8>,
    cmd: BadCmd,
) -> Result<Answer, idem::Error> {
    bad_effect(db, &cmd).await
}

#[idempotent(scope = "rel.bad.tenant", key = cmd.key, principal = tenant)]
async fn bad_tenant(
    db: &DatabaseConnection,
    tenant: String,
    cmd: BadCmd,
) -> Result<Answer, idem::Error> {
    bad_effect(db, &cmd).await
}

#[idempotent(scope = "rel.bad.optional", key = key, principal = tenant, skip(cmd))]
async fn bad_optional(
    db: &DatabaseConnection,
    key: Option<String>,
    tenant: Option<String>,
    cmd: BadCmd,
) -> Result<Answer, idem::Error> {
    bad_effect(db, &cmd).await
}

#[idempotent(scope = "rel.bad.decode", key = cmd.key)]
async fn decode_v1(db: &DatabaseConnection, cmd: BadCmd) -> Result<Answer, idem::Error> {
    bad_effect(db, &cmd).await
}

/// `decode_v1` after a deploy changed its return type.
#[idempotent(scope = "rel.bad.decode", key = cmd.key)]
async fn decode_v2(db: &DatabaseConnection, cmd: BadCmd) -> Result<u64, idem::Error> {
    bad_effect(db, &cmd).await.map(|a| a.amount as u64)
}

#[derive(Debug, Serialize, Deserialize)]
enum Declined {
    #[serde(skip)]
    #[allow(dead_code)] // carried, never inspected here
    Idem(idem::Error),
    Declined(String),
}

impl From<idem::Error> for Declined {
    fn from(e: idem::Error) -> Self {
        Self::Idem(e)
    }
}

impl idem::FinalError for Declined {
    fn is_final(&self) -> bool {
        matches!(self, Self::Declined(_))
    }
}

#[idempotent(scope = "rel.bad.final", key = cmd.key)]
async fn final_v1(db: &DatabaseConnection, cmd: BadCmd) -> Result<Answer, Declined> {
    bad_effect(db, &cmd).await?;
    Err(Declined::Declined("card declined".into()))
}

/// `final_v1` after a deploy whose error type is no longer a `FinalError`.
#[idempotent(scope = "rel.bad.final", key = cmd.key)]
async fn final_v2(db: &DatabaseConnection, cmd: BadCmd) -> Result<Answer, idem::Error> {
    bad_effect(db, &cmd).await
}

/// An argument whose `Serialize` fails.
#[derive(Debug, Clone, Deserialize)]
struct Unserializable;

impl Serialize for Unserializable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("this value refuses to serialise"))
    }
}

#[idempotent(scope = "rel.bad.arg", key = cmd.key)]
async fn bad_arg(
    db: &DatabaseConnection,
    cmd: BadCmd,
    extra: Unserializable,
) -> Result<Answer, idem::Error> {
    let _ = extra;
    bad_effect(db, &cmd).await
}

#[idempotent(scope = "rel.bad.result", key = cmd.key)]
async fn bad_result(db: &DatabaseConnection, cmd: BadCmd) -> Result<Unserializable, idem::Error> {
    bad_effect(db, &cmd).await?;
    Ok(Unserializable)
}

static TTL_ZERO: idem_core::engine::Site = idem_core::engine::Site::new(
    "rel.bad.ttl0",
    Duration::ZERO,
    idem::store::Concurrency::DEFAULT,
);

/// A handler built on the engine API with a TTL of zero (the attribute refuses `ttl = "0s"`
/// at compile time).
async fn ttl_zero(db: &DatabaseConnection, cmd: BadCmd) -> Result<Answer, idem::Error> {
    let mut call = idem_core::engine::Call::new(
        &TTL_ZERO,
        idem::sea_orm::SeaOrmStore::new(db),
        idem::Key::new(cmd.key.as_str()),
    );
    call.arg(&cmd);
    let guard = match call.claim::<Result<Answer, idem::Error>>(None).await {
        Ok(guard) => guard,
        Err(answer) => return answer,
    };
    let output = bad_effect(guard.tx(), &cmd).await;
    guard.finish(output).await
}

/// What a row of the table expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// This error kind, with this text in its message.
    Error(ErrorKind, &'static str),
    /// Accepted: executes once, then replays.
    Accepted,
    /// Finding: accepted, and a retry executes again.
    ExecutesEveryTime,
}

/// One malformed input.
#[derive(Debug, Clone, Copy)]
enum Input {
    Key(&'static str),
    KeyOwned(fn() -> String),
    KeyBytes(&'static [u8]),
    NoKey,
    Principal(&'static str),
    PrincipalOwned(fn() -> String),
    NoPrincipal,
    /// The key is recorded, then called with these arguments changed.
    Reused(fn(&mut BadCmd)),
    /// The return type changed since the record.
    DecodeTypeChanged,
    /// The recorded response is overwritten with these bytes (`None`: NULL).
    CorruptResponse(Option<&'static [u8]>),
    /// A final error was recorded; the handler's error type is no longer `FinalError`.
    FinalNoLongerFinal,
    /// The ledger row's state is set to this value.
    TamperedState(i16),
    /// The ledger row's fingerprint is overwritten with these bytes.
    TamperedFingerprint(&'static [u8]),
    MissingLedger,
    ArgumentCannotSerialise,
    ResultCannotSerialise,
    TtlZero,
}

const CASES: &[(&str, Input, Expect)] = {
    use ErrorKind::*;
    use Expect::*;
    use Input::*;
    &[
        ("empty key", Key(""), Error(InvalidKey, "empty")),
        (
            "256-byte ASCII key",
            KeyOwned(|| "k".repeat(256)),
            Error(InvalidKey, "256 bytes"),
        ),
        (
            "256-byte key of 2-byte chars",
            KeyOwned(|| "é".repeat(128)),
            Error(InvalidKey, "256 bytes"),
        ),
        (
            "10,000-byte key",
            KeyOwned(|| "x".repeat(10_000)),
            Error(InvalidKey, "10000 bytes"),
        ),
        (
            "NUL in key",
            Key("a\0b"),
            Error(InvalidKey, "control character at byte 1"),
        ),
        (
            "line feed in key",
            Key("order\n1"),
            Error(InvalidKey, "control character at byte 5"),
        ),
        (
            "CR LF at the end",
            Key("abc\r\n"),
            Error(InvalidKey, "control character at byte 3"),
        ),
        (
            "leading tab",
            Key("\tkey"),
            Error(InvalidKey, "control character at byte 0"),
        ),
        (
            "ANSI escape",
            Key("\u{1b}[2Jk"),
            Error(InvalidKey, "control character at byte 0"),
        ),
        (
            "DEL",
            Key("k\u{7f}"),
            Error(InvalidKey, "control character at byte 1"),
        ),
        (
            "C1 control NEL",
            Key("ab\u{85}"),
            Error(InvalidKey, "control character at byte 2"),
        ),
        (
            "C1 control CSI",
            Key("\u{9b}31m"),
            Error(InvalidKey, "control character at byte 0"),
        ),
        (
            "non-UTF-8 bytes",
            KeyBytes(b"\xff\xfe"),
            Error(InvalidKey, "not valid UTF-8"),
        ),
        (
            "overlong UTF-8",
            KeyBytes(b"\xc0\xaf"),
            Error(InvalidKey, "not valid UTF-8"),
        ),
        (
            "UTF-8 surrogate",
            KeyBytes(b"\xed\xa0\x80"),
            Error(InvalidKey, "not valid UTF-8"),
        ),
        (
            "truncated UTF-8",
            KeyBytes(b"ab\xe2\x82"),
            Error(InvalidKey, "not valid UTF-8"),
        ),
        (
            "control character as bytes",
            KeyBytes(b"a\x00"),
            Error(InvalidKey, "control character"),
        ),
        ("absent optional key", NoKey, Error(MissingKey, "missing")),
        ("empty principal", Principal(""), Error(InvalidKey, "empty")),
        (
            "control character in principal",
            Principal("acme\n"),
            Error(InvalidKey, "control"),
        ),
        (
            "256-byte principal",
            PrincipalOwned(|| "p".repeat(256)),
            Error(InvalidKey, "256 bytes"),
        ),
        (
            "absent optional principal",
            NoPrincipal,
            Error(MissingKey, "missing"),
        ),
        (
            "reused key, other amount",
            Reused(|c| c.amount += 1),
            Error(KeyReused, "rel.bad"),
        ),
        (
            "reused key, other run",
            Reused(|c| c.run.push('x')),
            Error(KeyReused, "rel.bad"),
        ),
        (
            "reused key, None -> Some",
            Reused(|c| c.note = Some(String::new())),
            Error(KeyReused, "rel.bad"),
        ),
        (
            "recorded type changed",
            DecodeTypeChanged,
            Error(Decode, "rel.bad.decode"),
        ),
        (
            "recorded response garbage",
            CorruptResponse(Some(b"\xff not json")),
            Error(Decode, "rel.bad"),
        ),
        (
            "recorded response truncated",
            CorruptResponse(Some(b"{\"key\":")),
            Error(Decode, "rel.bad"),
        ),
        (
            "recorded response NULL",
            CorruptResponse(None),
            Error(Decode, "rel.bad"),
        ),
        (
            "final error, type no longer final",
            FinalNoLongerFinal,
            Error(Decode, "FinalError"),
        ),
        (
            "unknown ledger state 9",
            TamperedState(9),
            Error(Store, "unknown state"),
        ),
        (
            "committed pending row (state 0)",
            TamperedState(0),
            Error(InFlight, "in flight"),
        ),
        (
            "fingerprint of 3 bytes",
            TamperedFingerprint(b"abc"),
            Error(KeyReused, "rel.bad"),
        ),
        (
            "missing ledger table",
            MissingLedger,
            Error(Store, "create_tables"),
        ),
        (
            "argument cannot serialise",
            ArgumentCannotSerialise,
            Error(Fingerprint, "refuses"),
        ),
        (
            "result cannot serialise",
            ResultCannotSerialise,
            Error(Encode, "refuses"),
        ),
        ("TTL of zero (engine API)", TtlZero, ExecutesEveryTime),
        (
            "SQL in the key",
            Key("'; DROP TABLE idem_ledger; --"),
            Accepted,
        ),
        (
            "255-byte key of 3-byte chars",
            KeyOwned(|| "€".repeat(85)),
            Accepted,
        ),
        ("key of spaces only", Key("   "), Accepted),
    ]
};

/// A connection to a database of the same server with no ledger table.
async fn without_ledger(b: &Backend) -> DatabaseConnection {
    match b.name {
        "sqlite" => connect("sqlite::memory:", 1).await,
        "postgres" => {
            b.db.execute_unprepared("CREATE SCHEMA IF NOT EXISTS idem_rel_empty")
                .await
                .expect("schema");
            let mut options = sea_orm::ConnectOptions::new(b.url.clone());
            options
                .sqlx_logging(false)
                .max_connections(2)
                .set_schema_search_path("idem_rel_empty");
            sea_orm::Database::connect(options).await.expect("connect")
        }
        _ => {
            b.db.execute_unprepared("CREATE DATABASE IF NOT EXISTS idem_rel_empty")
                .await
                .expect("database");
            let base = b.url.rsplit_once('/').expect("a database in the URL").0;
            connect(&format!("{base}/idem_rel_empty"), 2).await
        }
    }
}

/// Sets `column = value` on the ledger row of `(scope, key)`.
async fn tamper(
    db: &DatabaseConnection,
    scope: &str,
    key: &str,
    column: &str,
    value: sea_orm::Value,
) {
    let done = db
        .execute_raw(stmt(
            db,
            &format!("UPDATE idem_ledger SET {column} = ? WHERE scope = ? AND idem_key = ?"),
            vec![value, scope.into(), key.into()],
        ))
        .await
        .expect("tamper");
    assert_eq!(done.rows_affected(), 1);
}

/// What one case did.
struct CaseRun {
    /// The answer to the malformed call.
    result: Result<(), idem::Error>,
    /// The ledger row the case recorded first, as it was just before the malformed call.
    recorded: Option<(&'static str, String, Option<support::LedgerRow>)>,
    /// Executions that committed effects.
    executions: u32,
}

/// Whether `input` must be refused before any database work.
fn refused_before_the_database(input: Input) -> bool {
    matches!(
        input,
        Input::Key(_)
            | Input::KeyOwned(_)
            | Input::KeyBytes(_)
            | Input::NoKey
            | Input::Principal(_)
            | Input::PrincipalOwned(_)
            | Input::NoPrincipal
            | Input::ArgumentCannotSerialise
    )
}

/// Runs one case on `db` (`empty`: a database without the ledger table).
async fn run_case(
    db: DatabaseConnection,
    empty: DatabaseConnection,
    run: String,
    input: Input,
) -> CaseRun {
    let key = unique("bad");
    let c = BadCmd::new(&run, &key);
    let ok = |r: Result<Answer, idem::Error>| r.map(drop);
    // Cases that record a first call, then disturb it: the row just before the bad call.
    let recorded = |scope: &'static str| {
        let (db, key) = (db.clone(), key.clone());
        async move {
            let row = ledger_row(&db, scope, &key).await;
            Some((scope, key, row))
        }
    };
    // Valid keys run under a principal unique to the run, so a rerun on a persistent
    // server never meets an old record.
    let keyed = |k: &str| bad_tenant(&db, run.clone(), BadCmd::new(&run, k));
    let (result, recorded, executions) = match input {
        Input::Key(k) => (ok(keyed(k).await), None, 0),
        Input::KeyOwned(k) => (ok(keyed(&k()).await), None, 0),
        Input::KeyBytes(bytes) => (ok(bad_bytes(&db, bytes.to_vec(), c.clone()).await), None, 0),
        Input::NoKey => (
            ok(bad_optional(&db, None, Some("t".into()), c.clone()).await),
            None,
            0,
        ),
        Input::Principal(p) => (ok(bad_tenant(&db, p.to_owned(), c.clone()).await), None, 0),
        Input::PrincipalOwned(p) => (ok(bad_tenant(&db, p(), c.clone()).await), None, 0),
        Input::NoPrincipal => (
            ok(bad_optional(&db, Some(key.clone()), None, c.clone()).await),
            None,
            0,
        ),
        Input::Reused(change) => {
            bad_pay(&db, c.clone()).await.expect("the first call");
            let before = recorded("rel.bad").await;
            let mut other = c.clone();
            change(&mut other);
            (ok(bad_pay(&db, other).await), before, 1)
        }
        Input::DecodeTypeChanged => {
            decode_v1(&db, c.clone()).await.expect("v1");
            let before = recorded("rel.bad.decode").await;
            (decode_v2(&db, c).await.map(drop), before, 1)
        }
        Input::CorruptResponse(bytes) => {
            bad_pay(&db, c.clone()).await.expect("the first call");
            tamper(
                &db,
                "rel.bad",
                &key,
                "response",
                bytes.map(<[u8]>::to_vec).into(),
            )
            .await;
            let before = recorded("rel.bad").await;
            (ok(bad_pay(&db, c).await), before, 1)
        }
        Input::FinalNoLongerFinal => {
            let declined = final_v1(&db, c.clone()).await;
            assert!(
                matches!(declined, Err(Declined::Declined(_))),
                "{declined:?}"
            );
            let before = recorded("rel.bad.final").await;
            // A final error rolls the body's writes back: no execution committed effects.
            (ok(final_v2(&db, c).await), before, 0)
        }
        Input::TamperedState(state) => {
            bad_pay(&db, c.clone()).await.expect("the first call");
            tamper(&db, "rel.bad", &key, "state", state.into()).await;
            let before = recorded("rel.bad").await;
            (ok(bad_pay(&db, c).await), before, 1)
        }
        Input::TamperedFingerprint(bytes) => {
            bad_pay(&db, c.clone()).await.expect("the first call");
            tamper(&db, "rel.bad", &key, "fingerprint", bytes.to_vec().into()).await;
            let before = recorded("rel.bad").await;
            (ok(bad_pay(&db, c).await), before, 1)
        }
        Input::MissingLedger => (ok(bad_pay(&empty, c.clone()).await), None, 0),
        Input::ArgumentCannotSerialise => {
            let result = ok(bad_arg(&db, c.clone(), Unserializable).await);
            (result, Some(("rel.bad.arg", key.clone(), None)), 0)
        }
        Input::ResultCannotSerialise => {
            let result = bad_result(&db, c.clone()).await.map(drop);
            // Nothing was recorded before, and nothing may be after (the key is free).
            (result, Some(("rel.bad.result", key.clone(), None)), 0)
        }
        Input::TtlZero => {
            let first = ttl_zero(&db, c.clone()).await;
            let second = ttl_zero(&db, c.clone()).await;
            let executions = u32::from(first.is_ok()) + u32::from(second.is_ok());
            (first.and(second).map(drop), None, executions)
        }
    };
    let mut executions = executions;
    if result.is_ok() && matches!(input, Input::Key(_) | Input::KeyOwned(_)) {
        // An accepted key executed once; a retry replays.
        executions = 1;
        let again = match input {
            Input::Key(k) => ok(keyed(k).await),
            Input::KeyOwned(k) => ok(keyed(&k()).await),
            _ => Ok(()),
        };
        return CaseRun {
            result: again,
            recorded,
            executions,
        };
    }
    CaseRun {
        result,
        recorded,
        executions,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r6_bad_input_gets_the_documented_typed_error() {
    assert!(CASES.len() >= 25);
    for b in backends(4).await {
        let started = Instant::now();
        let empty = without_ledger(&b).await;
        let mut report = Vec::new();
        for (name, input, expect) in CASES.iter().copied() {
            let run = unique("r6");
            let task = tokio::spawn(run_case(b.db.clone(), empty.clone(), run.clone(), input));
            let case = task
                .await
                .unwrap_or_else(|e| panic!("{} {name}: panicked: {e}", b.name));
            // Recorded data untouched by the malformed call.
            if let Some((scope, key, before)) = &case.recorded {
                let after = ledger_row(&b.db, scope, key).await;
                assert_eq!(&after, before, "{} {name}: recorded data untouched", b.name);
            }
            let effects = snapshot(&b.db, "-", &run, None).await.effects;
            match expect {
                Expect::Error(kind, text) => {
                    let err = case
                        .result
                        .err()
                        .unwrap_or_else(|| panic!("{} {name}: accepted", b.name));
                    assert_eq!(err.kind(), kind, "{} {name}: {err}", b.name);
                    assert!(
                        err.to_string().contains(text),
                        "{} {name}: `{err}` does not say `{text}`",
                        b.name
                    );
                    if kind == ErrorKind::Decode {
                        // DESIGN §5: a Decode error names the scope and the key.
                        let (scope, key, _) = case.recorded.as_ref().expect("a recorded case");
                        let message = err.to_string();
                        assert!(
                            message.contains(scope) && message.contains(key.as_str()),
                            "{} {name}: `{message}` names neither {scope} nor {key}",
                            b.name
                        );
                    }
                    assert_eq!(
                        effects,
                        2 * i64::from(case.executions),
                        "{} {name}: only the recorded first call wrote",
                        b.name
                    );
                    if refused_before_the_database(input) {
                        // On a database without the ledger, any database work would be a
                        // Store error: the same answer proves none was done.
                        let again =
                            tokio::spawn(run_case(empty.clone(), empty.clone(), run, input))
                                .await
                                .unwrap_or_else(|e| panic!("{} {name}: panicked: {e}", b.name));
                        let again = again.result.err().map(|e| e.kind());
                        assert_eq!(
                            again,
                            Some(kind),
                            "{} {name}: before any database work",
                            b.name
                        );
                    }
                    report.push(format!("{name}: {}", kind.as_str()));
                }
                Expect::Accepted => {
                    case.result
                        .unwrap_or_else(|e| panic!("{} {name}: {e}", b.name));
                    assert_eq!(effects, 2, "{} {name}: executes once, then replays", b.name);
                    report.push(format!("{name}: accepted"));
                }
                Expect::ExecutesEveryTime => {
                    case.result
                        .unwrap_or_else(|e| panic!("{} {name}: {e}", b.name));
                    assert_eq!(case.executions, 2);
                    assert_eq!(effects, 4, "{} {name}: a retry executes again", b.name);
                    report.push(format!("{name}: FINDING: accepted, a retry executes again"));
                }
            }
        }
        eprintln!(
            "R6 {}: {} inputs, {:.1?}: {report:#?}",
            b.name,
            CASES.len(),
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// R7 isolation

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TenantCmd {
    key: String,
    tenant: String,
    run: String,
    amount: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct TenantAnswer {
    tenant: String,
    scope: String,
    execution: String,
}

async fn tenant_body<C: ConnectionTrait>(
    db: &C,
    scope: &str,
    cmd: &TenantCmd,
) -> Result<TenantAnswer, idem::Error> {
    let execution = unique("exec");
    effect(db, &cmd.run, &cmd.key, scope, &execution).await?;
    effect(db, &cmd.run, &cmd.key, scope, &execution).await?;
    Ok(TenantAnswer {
        tenant: cmd.tenant.clone(),
        scope: scope.to_owned(),
        execution,
    })
}

#[idempotent(scope = "rel.iso.a", key = cmd.key, principal = cmd.tenant)]
async fn iso_a(db: &DatabaseConnection, cmd: TenantCmd) -> Result<TenantAnswer, idem::Error> {
    tenant_body(db, "rel.iso.a", &cmd).await
}

#[idempotent(scope = "rel.iso.b", key = cmd.key, principal = cmd.tenant)]
async fn iso_b(db: &DatabaseConnection, cmd: TenantCmd) -> Result<TenantAnswer, idem::Error> {
    tenant_body(db, "rel.iso.b", &cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn r7_principals_and_scopes_are_isolated() {
    const TENANTS: usize = 16;
    const DUPLICATES: usize = 4;
    for b in backends(16).await {
        let started = Instant::now();
        let run = unique("r7");
        let key = format!("{run}-shared");
        let tenant_cmd = |tenant: &str, amount: i64| TenantCmd {
            key: key.clone(),
            tenant: tenant.to_owned(),
            run: run.clone(),
            amount,
        };

        // The same key under 16 principals, 4 concurrent duplicates each, and each tenant
        // with other arguments (a shared record would be KeyReused or a foreign replay).
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..TENANTS {
            for _ in 0..DUPLICATES {
                let (db, c) = (b.db.clone(), tenant_cmd(&format!("tenant-{t}"), t as i64));
                tasks.spawn(async move { (t, iso_a(&db, c).await) });
            }
        }
        let mut by_tenant: BTreeMap<usize, Vec<TenantAnswer>> = BTreeMap::new();
        for (t, answer) in tasks.join_all().await {
            let answer = answer.unwrap_or_else(|e| panic!("{} tenant {t}: {e}", b.name));
            assert_eq!(
                answer.tenant,
                format!("tenant-{t}"),
                "{}: another principal's result",
                b.name
            );
            by_tenant.entry(t).or_default().push(answer);
        }
        for (t, got) in &by_tenant {
            assert!(
                got.iter().all(|a| a == &got[0]),
                "{} tenant {t}: one answer",
                b.name
            );
        }
        let executions: std::collections::BTreeSet<_> = by_tenant
            .values()
            .map(|got| got[0].execution.clone())
            .collect();
        assert_eq!(
            executions.len(),
            TENANTS,
            "{}: one execution per principal",
            b.name
        );
        // Replays return each principal's own result.
        for t in [0, TENANTS - 1] {
            let again = iso_a(&b.db, tenant_cmd(&format!("tenant-{t}"), t as i64))
                .await
                .expect("replay");
            assert_eq!(again, by_tenant[&t][0], "{}", b.name);
        }

        // The same key and principal in another scope: a new execution, no collision.
        let other = iso_b(&b.db, tenant_cmd("tenant-0", 0))
            .await
            .expect("scope b");
        assert_eq!(other.scope, "rel.iso.b");
        assert_ne!(other.execution, by_tenant[&0][0].execution, "{}", b.name);
        assert_eq!(
            iso_b(&b.db, tenant_cmd("tenant-0", 0))
                .await
                .expect("b replay"),
            other
        );
        assert_eq!(
            iso_a(&b.db, tenant_cmd("tenant-0", 0))
                .await
                .expect("a replay"),
            by_tenant[&0][0]
        );

        // Principal/key boundaries cannot be shifted: (R+"a", "b"+R) and (R+"ab", R) read
        // the same once concatenated (R is the run id).
        let shift = |tenant: String, key: String| TenantCmd {
            key,
            tenant,
            run: run.clone(),
            amount: 0,
        };
        let one = iso_a(&b.db, shift(format!("{run}a"), format!("b{run}")))
            .await
            .expect("one");
        let two = iso_a(&b.db, shift(format!("{run}ab"), run.clone()))
            .await
            .expect("two");
        assert_ne!(one, two, "{}: shifted boundaries are other records", b.name);

        let effects = snapshot(&b.db, "-", &run, None).await;
        let expected = TENANTS + 1 + 2;
        assert_eq!(
            (effects.effects, effects.executions),
            (2 * expected as i64, expected as i64),
            "{}: {TENANTS} principals + 1 other scope + 2 shifted boundaries",
            b.name
        );
        let pending: i64 =
            b.db.query_one_raw(stmt(
                &b.db,
                "SELECT COUNT(*) FROM idem_ledger WHERE scope LIKE 'rel.iso.%' AND state = 0",
                vec![],
            ))
            .await
            .expect("pending")
            .expect("a row")
            .try_get_by_index(0)
            .expect("count");
        assert_eq!(pending, 0, "{}", b.name);
        eprintln!(
            "R7 {}: {TENANTS} principals x {DUPLICATES} concurrent duplicates of one key: \
             {TENANTS} executions, 0 foreign replays; another scope and 2 shifted boundaries: \
             3 more executions; {:.1?}",
            b.name,
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// R8 properties

mod properties {
    use super::*;
    use proptest::prelude::*;

    fn fingerprint<T: Serialize + ?Sized>(
        scope: &str,
        args: &[&T],
    ) -> (Vec<u8>, idem::Fingerprint) {
        let mut f = idem::Fingerprinter::new(scope);
        for a in args {
            f.arg(a).expect("serialisable");
        }
        (f.encoded().to_vec(), f.finish())
    }

    /// A map serialised in exactly the given entry order.
    struct InOrder(Vec<(String, i64)>);

    impl Serialize for InOrder {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
        }
    }

    #[derive(Debug, Clone, PartialEq, Serialize)]
    struct Order {
        id: u64,
        customer: String,
        lines: Vec<(String, u32)>,
        note: Option<String>,
        discount: Option<i16>,
        attributes: BTreeMap<String, String>,
    }

    fn order() -> impl Strategy<Value = Order> {
        (
            any::<u64>(),
            ".{0,12}",
            proptest::collection::vec((".{0,6}", any::<u32>()), 0..5),
            proptest::option::of(".{0,8}"),
            proptest::option::of(any::<i16>()),
            proptest::collection::btree_map(".{0,6}", ".{0,6}", 0..4),
        )
            .prop_map(|(id, customer, lines, note, discount, attributes)| Order {
                id,
                customer,
                lines,
                note,
                discount,
                attributes,
            })
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[idempotent(scope = "rel.prop", key = key, skip(runs))]
    async fn tagged(
        store: &idem::MemoryStore,
        key: String,
        tags: HashMap<String, i64>,
        runs: &AtomicUsize,
    ) -> Result<usize, idem::Error> {
        let _ = (store, tags);
        Ok(runs.fetch_add(1, Ordering::SeqCst))
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: if quick() { 256 } else { 1_000 },
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Canonical: equal values give equal bytes, whatever their map order.
        #[test]
        fn equal_values_give_equal_bytes(o in order(), entries in proptest::collection::vec((".{0,8}", any::<i64>()), 0..16)) {
            // An equal value built separately (its maps and strings are fresh allocations).
            let twin = Order {
                attributes: o.attributes.iter().rev().map(|(k, v)| (k.clone(), v.clone())).collect(),
                ..o.clone()
            };
            let (a, fa) = fingerprint("orders.pay", &[&o]);
            let (b, fb) = fingerprint("orders.pay", &[&twin]);
            prop_assert_eq!(&o, &twin);
            prop_assert_eq!(a, b);
            prop_assert_eq!(fa, fb);

            let sorted: BTreeMap<String, i64> = entries.iter().cloned().collect();
            let hashed: HashMap<String, i64> = entries.iter().cloned().collect();
            let mut reversed: Vec<(String, i64)> = sorted.clone().into_iter().collect();
            reversed.reverse();
            let canonical = fingerprint("s", &[&sorted]).0;
            prop_assert_eq!(&fingerprint("s", &[&hashed]).0, &canonical);
            prop_assert_eq!(&fingerprint("s", &[&InOrder(reversed)]).0, &canonical);
        }

        /// Canonical across number widths: `v` as u32, u64, i64 and i128 is one value.
        #[test]
        fn integer_widths_and_float_widths_agree(v in any::<u32>(), x in any::<f32>()) {
            let u = fingerprint("s", &[&v]).1;
            prop_assert_eq!(u, fingerprint("s", &[&u64::from(v)]).1);
            prop_assert_eq!(u, fingerprint("s", &[&i64::from(v)]).1);
            prop_assert_eq!(u, fingerprint("s", &[&i128::from(v)]).1);
            prop_assert_eq!(fingerprint("s", &[&x]).1, fingerprint("s", &[&f64::from(x)]).1);
        }

        /// Discriminating: different values, scopes or argument splits never collide.
        #[test]
        fn different_values_give_different_fingerprints(a in order(), b in order(), s in ".{0,8}", t in ".{0,8}") {
            prop_assume!(a != b);
            prop_assert_ne!(fingerprint("orders.pay", &[&a]).1, fingerprint("orders.pay", &[&b]).1);
            if s != t {
                prop_assert_ne!(fingerprint(&s, &[&a]).1, fingerprint(&t, &[&a]).1);
            }
            // Moving a character from one argument to the next changes the fingerprint.
            let joined = format!("{s}{t}");
            if let Some(c) = joined.chars().next() {
                let (head, tail) = joined.split_at(c.len_utf8());
                if head != s.as_str() {
                    prop_assert_ne!(fingerprint("x", &[head, tail]).1, fingerprint("x", &[s.as_str(), t.as_str()]).1);
                }
            }
        }

        /// Key parsing never panics on arbitrary bytes, and accepts exactly 1..=255 bytes of
        /// UTF-8 without control characters.
        #[test]
        fn key_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), text in "\\PC{0,40}|.{0,300}") {
            let valid = |s: &str| !s.is_empty() && s.len() <= idem::MAX_KEY_LEN && !s.chars().any(char::is_control);
            let parsed = idem::Key::from_bytes(&bytes);
            let expected = std::str::from_utf8(&bytes).is_ok_and(valid);
            prop_assert_eq!(parsed.is_ok(), expected);
            if let Err(e) = parsed {
                prop_assert_eq!(e.kind(), ErrorKind::InvalidKey);
            }
            let from_source = idem::KeySource::to_key(&bytes);
            prop_assert_eq!(from_source.is_ok(), expected);
            let parsed = idem::Key::new(text.as_str());
            prop_assert_eq!(parsed.is_ok(), valid(&text));
            if let Ok(k) = parsed {
                prop_assert_eq!(k.as_str(), text.as_str());
            }
        }

        /// The ledger id discriminates (scope, principal, key) triples: changing any one
        /// part, or moving a boundary between two parts, gives another id.
        #[test]
        fn record_ids_discriminate(
            base in (".{0,6}", ".{0,6}", ".{0,6}"),
            other in ".{0,6}",
            part in 0..3_usize,
            b in (".{0,6}", ".{0,6}", ".{0,6}"),
        ) {
            let id = |t: &(String, String, String)| idem::store::record_id(&t.0, &t.1, &t.2);
            let mut changed = base.clone();
            match part {
                0 => changed.0 = other,
                1 => changed.1 = other,
                _ => changed.2 = other,
            }
            if changed != base {
                prop_assert_ne!(id(&changed), id(&base));
            }
            // Move the first character of the key into the principal, and of the principal
            // into the scope.
            for (from, to) in [(2, 1), (1, 0)] {
                let mut parts = [base.0.clone(), base.1.clone(), base.2.clone()];
                if let Some(c) = parts[from].chars().next() {
                    parts[from].remove(0);
                    parts[to].push(c);
                    let shifted = (parts[0].clone(), parts[1].clone(), parts[2].clone());
                    prop_assert_ne!(id(&shifted), id(&base));
                }
            }
            if b != base {
                prop_assert_ne!(id(&b), id(&base));
            }
        }

        /// Through `#[idempotent]`: the same map in another order replays; another map is
        /// `KeyReused`.
        #[test]
        fn the_handler_sees_map_order_as_irrelevant(entries in proptest::collection::btree_map("[a-z]{1,6}", any::<i64>(), 1..12), extra in "[A-Z]{1,4}") {
            runtime().block_on(async {
                let store = idem::MemoryStore::new();
                let runs = AtomicUsize::new(0);
                let forward: HashMap<String, i64> = entries.clone().into_iter().collect();
                let mut backward = HashMap::new();
                for (k, v) in entries.iter().rev() {
                    backward.insert(k.clone(), *v);
                }
                let first = tagged(&store, "k".into(), forward, &runs).await.expect("first");
                let (again, outcome) = with_outcome(tagged(&store, "k".into(), backward, &runs)).await;
                prop_assert_eq!(again.expect("replay"), first);
                prop_assert_eq!(outcome, Some(Outcome::Replayed));
                let mut other: HashMap<String, i64> = entries.clone().into_iter().collect();
                other.insert(extra, 0);
                let reused = tagged(&store, "k".into(), other, &runs).await;
                prop_assert_eq!(reused.map_err(|e| e.kind()), Err(ErrorKind::KeyReused));
                prop_assert_eq!(runs.load(Ordering::SeqCst), 1);
                Ok(())
            })?;
        }
    }
}
