//! R1 storm: 10,000 calls over 1,000 keys (10 per key, shuffled) from 64 concurrent tasks,
//! 1 call in 10 an impatient client that drops its call and retries; each key executes once.
//! Through both stores (SeaORM's and sqlx's, tests/reliability/stores.rs).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem::{ErrorKind, Outcome, with_outcome};

use crate::stores::{
    Case, Conn, call, on_sea_orm, on_sqlx_mysql, on_sqlx_postgres, on_sqlx_sqlite,
    on_tokio_postgres,
};
use crate::support::{Answer, Backend, Probe, Rng, backends, key_of, quick, unique};
use crate::{assert_exactly_once, cmd, recorded_answers};

/// Longer than any call takes under the storm, conflict retries and their backoff included.
const HUNG: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
struct StormStats {
    answers: Vec<(usize, Answer, Option<Outcome>)>,
    cancelled: u64,
    in_flight: u64,
    errors: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_executes_each_key_once() {
    let (calls, keys, tasks_n) = if quick() {
        (2_000, 200, 64)
    } else {
        (10_000, 1_000, 64)
    };
    for b in backends(24).await {
        for case in Case::both(&b, 24).await {
            storm(&b, &case, calls, keys, tasks_n).await;
        }
    }
}

async fn storm(b: &Backend, case: &Case, calls: usize, keys: usize, tasks_n: usize) {
    let name = &case.name;
    let started = Instant::now();
    let run = unique("r1");
    let mut rng = Rng::new("r1");
    // Each key `calls / keys` times, shuffled: duplicates land on concurrent tasks at
    // random. One call in ten is an impatient client: it gives up after 0..4 ms (the
    // future is dropped wherever it is) and retries.
    let mut schedule: Vec<(usize, Option<u64>)> = (0..calls).map(|i| (i % keys, None)).collect();
    rng.shuffle(&mut schedule);
    for item in &mut schedule {
        if rng.chance(10) {
            item.1 = Some(rng.below(4_000));
        }
    }
    let (schedule, next) = (Arc::new(schedule), Arc::new(AtomicUsize::new(0)));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..tasks_n {
        let (case, run, schedule, next) =
            (case.clone(), run.clone(), schedule.clone(), next.clone());
        let name = name.clone();
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
                    let call =
                        with_outcome(async { call!(case, transfer(cmd.clone(), &Probe::Quiet)) });
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
                        // A call that never answers (a starved pool, a lost wake-up) fails
                        // the run here instead of hanging it.
                        None => match tokio::time::timeout(HUNG, call).await {
                            Ok(result) => result,
                            Err(_) => panic!("{name}: a call of key {k} hung for {HUNG:?}"),
                        },
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
        "{name}: unexpected errors: {:?}",
        all.errors
    );
    assert_eq!(all.answers.len(), calls, "{name}: every call answered");
    let recorded = recorded_answers(&b.db, &run).await;
    let mut executed = 0;
    for (k, answer, outcome) in &all.answers {
        let key = key_of(&run, *k);
        assert_eq!(
            Some(answer),
            recorded.get(&key),
            "{name}: every answer for {key} is the recorded one"
        );
        executed += usize::from(*outcome == Some(Outcome::Executed));
    }
    // A call cancelled after its commit executed without anyone seeing `Executed`.
    assert!(executed <= keys, "{name}: {executed} Executed outcomes");
    let s = assert_exactly_once(b, &run, keys, &format!("R1 ({})", case.store.as_str())).await;
    eprintln!(
        "R1 {name}: {calls} calls over {keys} keys from {tasks_n} tasks: {} executions, \
             {} duplicates, {} effect rows, pending {}, {} impatient calls cancelled, \
             {} in-flight retries, {:.1?}",
        s.executions,
        s.executions - keys as i64,
        s.effects,
        s.pending,
        all.cancelled,
        all.in_flight,
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------
