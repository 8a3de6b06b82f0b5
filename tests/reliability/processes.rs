//! R2 many processes: 4 OS processes (this test binary, re-executed) call the same keys in
//! their own orders on one database; each key executes once. Through both stores (the
//! workers' calls go through the case's store, `IDEM_REL_STORE`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::stores::Store;
use crate::support::{Answer, Backend, Rng, answers, backends, spawn_child, unique};
use crate::{assert_exactly_once, recorded_answers};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_execute_each_key_once() {
    for b in backends(4).await {
        for store in Store::on(&b.url) {
            four_processes(&b, store).await;
        }
    }
}

const PROCESSES: usize = 4;
const KEYS: usize = 500;

async fn four_processes(b: &Backend, store: Store) {
    let name = format!("{} ({})", b.name, store.as_str());
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
                    ("IDEM_REL_STORE", store.as_str().into()),
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
        assert!(errors.is_empty(), "{name}: worker errors: {errors:?}");
        assert!(
            process.iter().any(|l| l.starts_with("DONE")),
            "{name}: a worker did not finish"
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
    assert_eq!(by_key.len(), KEYS, "{name}: every key answered");
    let recorded = recorded_answers(&b.db, &run).await;
    let mut executed = 0;
    for (key, got) in &by_key {
        assert_eq!(
            got.len(),
            PROCESSES,
            "{name}: {key} answered in every process"
        );
        for (outcome, answer) in got {
            assert_eq!(Some(answer), recorded.get(key), "{name}: {key}");
            executed += usize::from(outcome == "Executed");
        }
    }
    assert_eq!(executed, KEYS, "{name}: one Executed outcome per key");
    let s = assert_exactly_once(b, &run, KEYS, &format!("R2 ({})", store.as_str())).await;
    eprintln!(
        "R2 {name}: {PROCESSES} processes x {KEYS} keys ({} calls): {} executions, {} effect \
             rows, pending {}, {in_flight} in-flight retries, {:.1?}",
        PROCESSES * KEYS,
        s.executions,
        s.effects,
        s.pending,
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------
