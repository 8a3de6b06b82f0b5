//! The crash-point harness: runs a handler's call once per crash point idem has on its path,
//! kills it there, lets a retry (or a completer, then the retry) finish it, and checks that
//! its effects happened as in a run without a crash and that the answer is the recorded one.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use super::crash_points::{Plan, Reached};
use crate::call::outcome::{Outcome, with_outcome};
use crate::ledger::ids::random_token;

/// How long one call of a crash test may take before the test reports it hung.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest an answer or an effect count is shown in a [`CrashReport`].
const SHOWN_CHARS: usize = 72;

/// One run of a [`CrashTest`], as its `setup` sees it: the clean run (`crash: None`) or the
/// run that crashes at `crash`. Each gets fresh state from `setup`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Scenario {
    /// 0 for the clean run, then 1, 2, … for each crash point.
    pub index: usize,
    /// An idempotency key no other run of this test (nor of another test) uses.
    pub key: String,
    /// Where this run crashes (`None`: the clean run).
    pub crash: Option<Reached>,
}

/// The run's state, the call's value and error: named by the closures' signatures, not held.
type Types<S, T, E> = PhantomData<fn() -> (S, T, E)>;

/// A crash test of one handler: `setup` makes a run's state (an order to pay, a fresh key),
/// `call` makes the handler's call on it (the same call again is its retry), `effects`
/// counts what the handler did to the world (rows, messages, charges at a fake gateway).
///
/// [`run`](Self::run) makes the call once without a crash, to learn its crash points and
/// what it does; then, for each point, on fresh state: calls it and kills it at that point
/// (the call's future is dropped there, as a process that dies: open transactions roll back,
/// a lease is left held, and the harness ends it as its expiry would), runs the
/// [completer](Self::completer) if there is one, retries the call, calls it once more, and
/// checks that the effects are what the clean run's were, that the retry answered what the
/// last call replays (the recorded answer), and, with a completer, that the retry was a
/// replay. A handler's effect that idem does not protect (done outside `idem::step` in lease
/// mode, or a step whose key the receiver ignores) is counted twice at some point, and the
/// report names it.
///
/// ```text
/// CrashTest::new(
///     async |scenario| Order::pending(&db, &scenario.key).await,   // each run's state
///     async |order: &Order| pay(&db, &gateway, order.key(), order.id()).await,
///     async |order: &Order| (gateway.charges_of(order), payments_of(&db, order).await),
/// )
/// .run()
/// .await
/// .assert_once();   // panics with the table of crash points if one failed
/// ```
///
/// (A compiled example is in `idem::testing`'s docs and the guide's "Crash-testing your
/// handlers", `docs/guide/testing.md`.)
#[must_use = "a crash test does nothing until `run` is awaited"]
pub struct CrashTest<S, X, T, E, Setup, Call, Count, Finish = NoCompleter> {
    setup: Setup,
    call: Call,
    count: Count,
    finish: Finish,
    expected: Option<X>,
    timeout: Duration,
    types: Types<S, T, E>,
}

impl<S, X, T, E, Setup, Call, Count, Finish> fmt::Debug
    for CrashTest<S, X, T, E, Setup, Call, Count, Finish>
where
    X: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CrashTest")
            .field("expected", &self.expected)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// A crash test without a completer: the client's retry finishes each crashed call.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCompleter;

/// A crash test's completer: an async closure that runs one round of it.
#[derive(Debug)]
pub struct WithCompleter<C>(C);

/// What finishes a crashed call before the client's retry: nothing, or a completer round
/// over the run's state `S`.
pub trait Finisher<S> {
    /// Runs the completer, if any; whether there is one.
    fn finish(&mut self, state: &S) -> impl Future<Output = bool>;
}

impl<S> Finisher<S> for NoCompleter {
    async fn finish(&mut self, _state: &S) -> bool {
        false
    }
}

impl<S, C: AsyncFnMut(&S)> Finisher<S> for WithCompleter<C> {
    async fn finish(&mut self, state: &S) -> bool {
        (self.0)(state).await;
        true
    }
}

impl<S, X, T, E, Setup, Call, Count> CrashTest<S, X, T, E, Setup, Call, Count, NoCompleter>
where
    Setup: AsyncFnMut(&Scenario) -> S,
    Call: AsyncFnMut(&S) -> Result<T, E>,
    Count: AsyncFnMut(&S) -> X,
{
    /// A crash test of the call `call` makes on the state `setup` makes for each run, whose
    /// effects `effects` counts.
    pub fn new(setup: Setup, call: Call, effects: Count) -> Self {
        Self {
            setup,
            call,
            count: effects,
            finish: NoCompleter,
            expected: None,
            timeout: DEFAULT_CALL_TIMEOUT,
            types: PhantomData,
        }
    }

    /// Runs `round` on the run's state (one round of the service's completer, e.g.
    /// `completer.run_once()`) after each crash, before the client's retry: the completer
    /// must finish the crashed call, so that the retry replays its answer (checked for a
    /// call that crashed holding a lease).
    pub fn completer<C: AsyncFnMut(&S)>(
        self,
        round: C,
    ) -> CrashTest<S, X, T, E, Setup, Call, Count, WithCompleter<C>> {
        CrashTest {
            setup: self.setup,
            call: self.call,
            count: self.count,
            finish: WithCompleter(round),
            expected: self.expected,
            timeout: self.timeout,
            types: PhantomData,
        }
    }
}

impl<S, X, T, E, Setup, Call, Count, Finish> CrashTest<S, X, T, E, Setup, Call, Count, Finish>
where
    X: PartialEq + fmt::Debug,
    T: PartialEq + fmt::Debug,
    E: fmt::Debug,
    Setup: AsyncFnMut(&Scenario) -> S,
    Call: AsyncFnMut(&S) -> Result<T, E>,
    Count: AsyncFnMut(&S) -> X,
    Finish: Finisher<S>,
{
    /// What the effects must count in every run, the clean one included (without it, the
    /// crashed runs must count what the clean run did).
    pub fn expect_effects(mut self, effects: X) -> Self {
        self.expected = Some(effects);
        self
    }

    /// How long each call may take before the test reports it hung (30 s by default).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs the test: the clean run, then one run per crash point it reached. Never panics
    /// for the handler's failures: they are in the report ([`CrashReport::assert_once`]).
    pub async fn run(mut self) -> CrashReport {
        if super::is_disabled() {
            return CrashReport {
                reference: CrashRun {
                    index: 0,
                    crash: None,
                    effects: String::new(),
                    answer: String::new(),
                    outcome: None,
                    failures: vec![
                        "idem is switched off (IDEM_DISABLED, idem::testing::disable or run_disabled): its calls have no crash points".to_owned(),
                    ],
                },
                points: Vec::new(),
            };
        }
        let test = format!("crash-test-{:x}", random_token().unsigned_abs());
        let clean = Scenario {
            index: 0,
            key: format!("{test}-clean"),
            crash: None,
        };
        let state = (self.setup)(&clean).await;
        let plan = Plan::new(None);
        let ran = within(self.timeout, plan.scope((self.call)(&state))).await;
        let points = plan.reached();
        let mut reference = CrashRun {
            index: 0,
            crash: None,
            effects: String::new(),
            answer: String::new(),
            outcome: None,
            failures: Vec::new(),
        };
        let Some(answer) = ran else {
            reference.failures.push(hung(self.timeout, "the call"));
            return CrashReport {
                reference,
                points: Vec::new(),
            };
        };
        let pinned = self.expected.take();
        let effects = self
            .check_finished(&state, &answer, pinned.as_ref(), "expected", &mut reference)
            .await;
        if points.is_empty() {
            reference.failures.push(
                "the call reached no crash point: is it an `#[idempotent]` call, made in the test's task?"
                    .to_owned(),
            );
        }
        if !reference.failures.is_empty() {
            // A clean run that fails says it all; its crash points would only repeat it.
            return CrashReport {
                reference,
                points: Vec::new(),
            };
        }
        let against = if pinned.is_some() {
            "expected"
        } else {
            "a run without a crash counted"
        };
        let expected = pinned.unwrap_or(effects);

        let mut rows = Vec::new();
        for (index, point) in points.into_iter().enumerate() {
            let scenario = Scenario {
                index: index + 1,
                key: format!("{test}-{}", index + 1),
                crash: Some(point),
            };
            rows.push(self.crash_at(index, scenario, &expected, against).await);
        }
        CrashReport {
            reference,
            points: rows,
        }
    }

    /// One run crashed at the `index`-th point, then finished and checked.
    async fn crash_at(
        &mut self,
        index: usize,
        scenario: Scenario,
        expected: &X,
        against: &str,
    ) -> CrashRun {
        let point = scenario.crash.clone();
        let mut row = CrashRun {
            index: scenario.index,
            crash: point.clone(),
            effects: String::new(),
            answer: String::new(),
            outcome: None,
            failures: Vec::new(),
        };
        let state = (self.setup)(&scenario).await;
        let plan = Plan::new(Some(index));
        let ran = within(self.timeout, until_crash(&plan, (self.call)(&state))).await;
        match ran {
            None => {
                row.failures
                    .push(hung(self.timeout, "the call before its crash"));
                return row;
            }
            Some(Some(answer)) => row.failures.push(format!(
                "the call did not reach this point again (it reached {} points, then answered {}): its path depends on more than its state",
                plan.reached().len(),
                shown(&answer)
            )),
            Some(None) => {
                let reached = plan.reached();
                if reached.last() != point.as_ref() {
                    row.failures.push(format!(
                        "the call crashed at another point ({}): its path depends on more than its state",
                        reached.last().map_or("none".to_owned(), ToString::to_string)
                    ));
                }
            }
        }
        // The process is dead: its lease ends (now, rather than after its length).
        let held = plan.lease();
        if let Some(end_lease) = &held
            && let Err(e) = end_lease().await
            && e.kind() != crate::ErrorKind::LeaseLost
        {
            row.failures
                .push(format!("ending the crashed call's lease failed: {e}"));
        }
        let completed = self.finish.finish(&state).await;
        let retried = within(self.timeout, with_outcome((self.call)(&state))).await;
        let Some((answer, outcome)) = retried else {
            row.failures.push(hung(self.timeout, "the retry"));
            return row;
        };
        row.outcome = outcome;
        if completed && held.is_some() && outcome != Some(Outcome::Replayed) {
            row.failures.push(format!(
                "the completer did not finish the call: the retry {} it",
                outcome.map_or("answered without running", |_| "executed")
            ));
        }
        self.check_finished(&state, &answer, Some(expected), against, &mut row)
            .await;
        row
    }

    /// Checks a finished call whose answer was `answer`: a replay answers the same, and the
    /// effects count `expected` (if known; `against` says where it came from). Returns the
    /// effects counted.
    async fn check_finished(
        &mut self,
        state: &S,
        answer: &Result<T, E>,
        expected: Option<&X>,
        against: &str,
        row: &mut CrashRun,
    ) -> X {
        row.answer = shown(answer);
        let replayed = within(self.timeout, (self.call)(state)).await;
        match replayed {
            None => row.failures.push(hung(self.timeout, "the replay")),
            Some(replay) if !same(answer, &replay) => row.failures.push(format!(
                "the answer is not the recorded one: the call answered {}, a replay {}",
                shown(answer),
                shown(&replay)
            )),
            Some(_) => {}
        }
        let effects = (self.count)(state).await;
        row.effects = shown(&effects);
        if let Some(expected) = expected
            && effects != *expected
        {
            row.failures.push(format!(
                "effects counted {}, {against} {}",
                shown(&effects),
                shown(expected)
            ));
        }
        effects
    }
}

/// The failure of a call that hung.
fn hung(timeout: Duration, what: &str) -> String {
    format!("{what} did not answer within {timeout:?}")
}

/// `future`, or `None` past `timeout`.
async fn within<F: Future>(timeout: Duration, future: F) -> Option<F::Output> {
    tokio::time::timeout(timeout, future).await.ok()
}

/// Polls `call` under `plan` until it answers (`Some`) or crashes (`None`: it is dropped
/// there, as the process's death would stop it).
async fn until_crash<F: Future>(plan: &Arc<Plan>, call: F) -> Option<F::Output> {
    let mut call = pin!(plan.scope(call));
    std::future::poll_fn(|cx| match call.as_mut().poll(cx) {
        // A step that failed at its crash point may still answer: the process died there.
        Poll::Ready(_) if plan.crashed() => Poll::Ready(None),
        Poll::Ready(answer) => Poll::Ready(Some(answer)),
        Poll::Pending if plan.crashed() => Poll::Ready(None),
        Poll::Pending => Poll::Pending,
    })
    .await
}

/// Whether two answers are the same: equal values, or errors that print the same.
fn same<T: PartialEq, E: fmt::Debug>(a: &Result<T, E>, b: &Result<T, E>) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => a == b,
        (Err(a), Err(b)) => format!("{a:?}") == format!("{b:?}"),
        _ => false,
    }
}

/// `value`'s `Debug`, cut to [`SHOWN_CHARS`].
fn shown<V: fmt::Debug + ?Sized>(value: &V) -> String {
    let text = format!("{value:?}");
    match text.char_indices().nth(SHOWN_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// What a [`CrashTest`] found: its clean run, and each crash point's run.
#[derive(Debug, Clone)]
pub struct CrashReport {
    reference: CrashRun,
    points: Vec<CrashRun>,
}

/// One run of a crash test: where it crashed, what its effects counted, what it answered in
/// the end, and what went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CrashRun {
    /// 0 for the clean run, then 1, 2, … for each crash point.
    pub index: usize,
    /// Where the run crashed (`None`: the clean run).
    pub crash: Option<Reached>,
    /// The effects counted once the call was finished (`Debug` of the count).
    pub effects: String,
    /// The call's answer once finished (`Debug`, cut to 72 characters).
    pub answer: String,
    /// How the retry after the crash was answered (`None` for the clean run).
    pub outcome: Option<Outcome>,
    /// Why the run failed; empty when it passed.
    pub failures: Vec<String>,
}

impl CrashRun {
    /// Whether the run passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

impl CrashReport {
    /// The clean run.
    pub fn reference(&self) -> &CrashRun {
        &self.reference
    }

    /// The run of each crash point the clean run reached, in order.
    pub fn points(&self) -> &[CrashRun] {
        &self.points
    }

    /// Whether the clean run and every crash point passed.
    pub fn passed(&self) -> bool {
        self.reference.passed() && self.points.iter().all(CrashRun::passed)
    }

    /// The runs that failed.
    pub fn failures(&self) -> impl Iterator<Item = &CrashRun> {
        std::iter::once(&self.reference)
            .chain(&self.points)
            .filter(|row| !row.passed())
    }

    /// Panics with the report's table unless every run passed: the effects happened once
    /// (as in the clean run) and the answer was the recorded one, whatever the crash point.
    #[track_caller]
    pub fn assert_once(&self) {
        assert!(self.passed(), "the crash test failed:\n{self}");
    }
}

impl fmt::Display for CrashReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed = self.failures().count();
        writeln!(
            f,
            "{} crash points, {}",
            self.points.len(),
            if failed == 0 {
                "all passed".to_owned()
            } else {
                format!("{failed} failed")
            }
        )?;
        let rows = std::iter::once(&self.reference).chain(&self.points);
        let labels: Vec<String> = rows
            .clone()
            .map(|row| {
                row.crash
                    .as_ref()
                    .map_or("no crash".to_owned(), ToString::to_string)
            })
            .collect();
        let width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
        let effects = rows.clone().map(|r| r.effects.len()).max().unwrap_or(0);
        writeln!(
            f,
            "  #  {:width$}  {:effects$}  then",
            "crash point",
            "effects",
            effects = effects.max(7)
        )?;
        for (row, label) in rows.zip(labels) {
            let then = match (row.passed(), row.outcome) {
                (false, _) => format!("FAILED: {}", row.failures.join("; ")),
                (true, Some(Outcome::Replayed)) => format!("ok, retry replayed {}", row.answer),
                (true, Some(Outcome::Executed)) => format!("ok, retry executed {}", row.answer),
                (true, None) => format!("ok, answered {}", row.answer),
            };
            writeln!(
                f,
                "{:>3}  {label:width$}  {:effects$}  {then}",
                row.index,
                row.effects,
                effects = effects.max(7)
            )?;
        }
        Ok(())
    }
}
