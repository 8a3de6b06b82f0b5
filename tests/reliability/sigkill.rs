//! R3 crash: child processes SIGKILLed at named and random points of a call; nothing is lost
//! or duplicated, and a retry completes each key exactly once. Through both stores (the
//! children's calls go through the case's store, `IDEM_REL_STORE`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::stores::Store;
use crate::support::{
    Backend, Rng, SCOPE, Snapshot, answers, backends, quick, recorded_answer, snapshot,
    spawn_child, unique,
};
use crate::{assert_exactly_once, cmd, recorded_answers};

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
async fn sigkill_at_random_points_loses_and_duplicates_nothing() {
    let kills = if quick() { 40 } else { 100 };
    for b in backends(4).await {
        for store in Store::on(&b.url) {
            sigkills(&b, store, kills).await;
        }
    }
}

async fn sigkills(b: &Backend, store: Store, kills: usize) {
    let name = format!("{} ({})", b.name, store.as_str());
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
                ("IDEM_REL_STORE", store.as_str().to_owned()),
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
        assert_eq!(s.pending, 0, "{name} {kill:?}: a key left claimed");
        assert_eq!(s.other, 0, "{name} {kill:?}");
        assert!(s.completed <= 1, "{name} {kill:?}: {s:?}");
        assert_eq!(
            (s.effects, s.executions),
            (2 * s.completed, s.completed),
            "{name} {kill:?} (last seen: {reached}): effects must be all or nothing: {s:?}"
        );
        match kill {
            KillAt::Point("after-commit") => {
                assert_eq!(s.completed, 1, "{name}: committed before the kill");
                let (_, outcome, answer) = first_answer.clone().expect("an answer");
                assert_eq!(outcome, "Executed");
                assert_eq!(
                    recorded_answer(&b.db, &c.key).await.as_ref(),
                    Some(&answer),
                    "{name}: the committed result is the one the killed run returned"
                );
            }
            KillAt::Point(p) => assert_eq!(
                s.completed, 0,
                "{name}: killed at {p}, nothing may be committed"
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
            "{name}: retry failed: {}",
            done.stderr
        );
        if let Some(window) = done.between("AT before-commit", "ANSWER") {
            commit_window = window;
        }
        let retry = done.lines;
        let (_, outcome, answer) = answers(&retry)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("{name} {kill:?}: the retry did not answer: {retry:?}"));
        if s.completed == 1 {
            assert_eq!(outcome, "Replayed", "{name} {kill:?}");
        }
        if let Some((_, _, first)) = &first_answer {
            assert_eq!(&answer, first, "{name} {kill:?}: no committed result lost");
        }
        assert_eq!(
            recorded_answer(&b.db, &c.key).await.as_ref(),
            Some(&answer),
            "{name}: the retry's answer is the recorded one"
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
            "{name} {kill:?}: exactly one execution after the retry"
        );
    }

    // One more process replays every key: nothing executes again.
    let (url, run2) = (b.url.clone(), run.clone());
    let replay = tokio::task::spawn_blocking(move || {
        spawn_child(&[
            ("IDEM_REL_MODE", "worker".into()),
            ("IDEM_REL_STORE", store.as_str().into()),
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
        "{name}: replay failed: {}",
        replay.stderr
    );
    let recorded = recorded_answers(&b.db, &run).await;
    let replayed = answers(&replay.lines);
    assert_eq!(
        replayed.len(),
        kills,
        "{name}: the replay answered {} of {kills} keys; its errors and end: {:?}",
        replayed.len(),
        replay
            .lines
            .iter()
            .filter(|l| l.starts_with("ERROR") || l.starts_with("DONE"))
            .collect::<Vec<_>>()
    );
    for (key, outcome, answer) in replayed {
        assert_eq!(outcome, "Replayed", "{name}: {key}");
        assert_eq!(Some(&answer), recorded.get(&key), "{name}: {key}");
    }
    let s = assert_exactly_once(b, &run, kills, &format!("R3 ({})", store.as_str())).await;
    retry_times.sort();
    eprintln!(
        "R3 {name}: {kills} SIGKILLs, then a retry each: {} executions, {} effect rows, \
             pending {}; kills (count, committed before the kill): {tally:?}; last point \
             the child reported before the kill: {reached_tally:?}; retry median {:.0?}; \
             commit window {commit_window:.1?}; {:.1?}",
        s.executions,
        s.effects,
        s.pending,
        retry_times[retry_times.len() / 2],
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------
