//! A model-checked specification (stateright) of idem's lease protocol for one idempotency key:
//! the claim, the fencing token, the recorded steps, the completer and the give-up.
//!
//! # The model
//!
//! One ledger row (`Absent`, `Pending { token, lease_left, attempts }`, `Done { answer }`,
//! `GaveUp`) and its steps table (`charge`, `final`: value and the token that wrote it, deleted
//! when the row leaves `Pending`). The handler has two phases: a charge at a payment gateway
//! (outside the database, deduplicated by a key derived from the idempotency key and the step
//! name, Stripe-style), then a final phase that inserts the `payment` row. Processes, each of
//! which can crash between two of its database transactions (its local state is lost):
//!
//! - clients (a request and its retry, same key): claim, then run the handler or get the
//!   recorded answer, `InFlight`, or the give-up; a crashed client comes back as a fresh
//!   process (a retry) or never;
//! - completers: take over `Pending` rows whose lease ended, exactly as a retry would, counting
//!   an attempt; give up (one transaction: the row leaves `Pending`, which fences out every
//!   holder, and the give-up hook is owed) once `attempts >= MAX_ATTEMPTS`; run the owed hook
//!   and then clear the flag (a crash in between runs it again). A crashed completer restarts.
//!
//! Every holder's write is fenced: it commits only while the row is `Pending` under the
//! holder's token. A takeover bumps the token and replays the recorded steps instead of running
//! them again. A gateway failure (before or after the charge was made, the response lost)
//! releases the lease (fenced: the lease ends now) and stops that holder.
//!
//! Decision: once the final phase committed (step `final` recorded, the payment row written),
//! the call is not given up: a completer takes it over whatever its attempts and completes it
//! from the recorded steps. So a `GaveUp` row never has a payment; it may have a charge at the
//! gateway (the charge happened, the final phase did not), which is what the hook is for.
//!
//! # Mapping to the code
//!
//! Claim, takeover and `InFlight`: `claim` in idem-sea-orm/src/lease.rs (`claim_lease`), driven
//! by `run_lease` in idem-core/src/lease.rs. Record step `charge`: `idem::step` (idem-core) and
//! `record_step`, fenced by `fence`. Final phase: `idem::sea_orm::final_step` (fence, the
//! payment insert and the step in one transaction). Complete: `complete` (`UPDATE … WHERE owner
//! = ? AND state = 0`, steps deleted). Release: `release_lease`; renewal: `renew`. The
//! completer and the give-up stand for `idem::sea_orm::Completer` (being written): it rebuilds
//! the call from the arguments stored with the claim, which live in the `Pending` row itself.
//!
//! # What is abstracted
//!
//! One key, one handler. The clock is the database's, in ticks; the row keeps what the
//! protocol compares, the lease's ticks left (`lease_end - now`), so time needs no horizon.
//! `Tick` runs while some lease is live; a tick during which the lease's holder is alive means
//! that holder is slow (it did not renew in time), and those are bounded (`slow_ticks`), as are
//! crashes (`crash_budget`). A completer's attempts past `ATTEMPT_BOUND` are cut off
//! (`within_boundary`): such a path stands for one that retries forever. The record's TTL and
//! purge, fingerprints, and `wait` polling are not modelled (an `InFlight` answer is final; the
//! second client is the retry).
//!
//! # Properties
//!
//! Safety (`always`): at most one payment row; at most one charge at the gateway; a `Done` call
//! has exactly one payment, of the one charge, and that is its answer; a `GaveUp` call has no
//! payment; a give-up happens at most once, and its hook has run once the flag is cleared; every
//! answer a client got is the recorded one. Liveness (`eventually`, on every path to a terminal
//! state): every call ends (`Done`, or `GaveUp` with its hook run). Examples (`sometimes`) keep
//! those from being vacuous. The model has no cycles (every action uses up a budget or moves a
//! process on), so stateright's `eventually`, checked on terminal states, covers every run; and
//! "ended" is stable, so it does not depend on the path taken to a state.
//!
//! The mutation tests remove one guard each and expect the property it protects to fail.

use std::collections::BTreeSet;
use std::time::Instant;

use stateright::{Checker, Expectation, HasDiscoveries, Model, Property};

/// Length of a lease, in ticks.
const LEASE_TICKS: u8 = 2;
/// A completer gives up an ended lease once this many completer attempts were made.
const MAX_ATTEMPTS: u8 = 2;
/// The checker does not follow a completer's attempts past this: stands for "forever".
const ATTEMPT_BOUND: u8 = 6;

const ONE_PAYMENT: &str = "at most one payment row";
const ONE_CHARGE: &str = "at most one charge at the gateway";
const DONE_PAID_ONCE: &str = "a Done call has one payment, of the one charge, as its answer";
const GAVE_UP_UNPAID: &str = "a GaveUp call has no payment";
const ONE_GIVE_UP: &str = "a give-up happens at most once";
const HOOK_RAN: &str = "a give-up's hook has run once its flag is cleared";
const ANSWERS_RECORDED: &str = "every answer a client got is the recorded one";
const WITHIN_BOUND: &str = "completer attempts stay below the model's bound";
const CALL_ENDS: &str = "every call ends";
const DONE_REACHABLE: &str = "a call can be done";
const GAVE_UP_REACHABLE: &str = "a call can be given up";
const TAKEOVER_AFTER_CRASH: &str = "a crashed holder's lease can be taken over";
const ZOMBIE_FENCED: &str = "a zombie holder can be fenced out";

type Token = u8;
/// A charge is named by its position in the gateway's list.
type ChargeId = u8;

/// The variant to check: sizes, budgets, and the guards a mutation test removes.
#[derive(Clone, Debug)]
struct Protocol {
    clients: usize,
    completers: usize,
    crash_budget: u8,
    slow_ticks: u8,
    /// Step, final phase and complete check the token (off: they check only `Pending`).
    fence: bool,
    /// Completers give up after `MAX_ATTEMPTS` (off: they retry forever).
    give_up: bool,
    /// Every gateway call fails for this key.
    gateway_always_fails: bool,
    /// Mutation: the gateway key is derived per attempt (from the token), not per step.
    key_per_attempt: bool,
    /// The final phase also completes the call (steps 4 and 5 in one transaction).
    final_completes: bool,
}

impl Protocol {
    fn guarded() -> Self {
        Self {
            clients: 2,
            completers: 2,
            crash_budget: 2,
            slow_ticks: LEASE_TICKS,
            fence: true,
            give_up: true,
            gateway_always_fails: false,
            key_per_attempt: false,
            final_completes: false,
        }
    }

    fn is_client(&self, who: usize) -> bool {
        who < self.clients
    }

    /// The fence of a holder's step, final phase and completion.
    fn fenced(&self, row: &Row, token: Token) -> bool {
        match row {
            Row::Pending { token: current, .. } => !self.fence || *current == token,
            _ => false,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Row {
    Absent,
    Pending {
        token: Token,
        lease_left: u8,
        attempts: u8,
    },
    Done {
        answer: ChargeId,
    },
    GaveUp,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Step {
    value: ChargeId,
    token: Token,
}

/// What a holder does next.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Phase {
    Charge,
    Release,
    RecordCharge(ChargeId),
    Final(ChargeId),
    Complete(ChargeId),
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Answer {
    Paid(ChargeId),
    InFlight,
    Failed,
    LeaseLost,
    GaveUp,
}

/// A process's local state (lost in a crash).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Local {
    /// A client about to submit; an idle completer.
    Ready,
    Holding {
        token: Token,
        phase: Phase,
    },
    /// A completer ran the give-up hook and has not cleared the flag yet.
    RanHook,
    Answered(Answer),
    /// A client that crashed and never came back.
    Gone,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct World {
    row: Row,
    charge_step: Option<Step>,
    final_step: Option<Step>,
    /// The final phase's effect: the charge each payment row references.
    payments: Vec<ChargeId>,
    /// The gateway's charges, by the key they were made with.
    charges: Vec<u8>,
    gateway_calls: u8,
    hook_owed: bool,
    hook_runs: u8,
    give_ups: u8,
    crashes_left: u8,
    slow_ticks_left: u8,
    /// The current holder crashed, and its lease was not taken over yet (for an example).
    holder_crashed: bool,
    taken_over_after_crash: bool,
    zombie_fenced: bool,
    processes: Vec<Local>,
}

impl World {
    fn holder_alive(&self, token: Token) -> bool {
        self.processes
            .iter()
            .any(|p| matches!(p, Local::Holding { token: t, .. } if *t == token))
    }

    /// Where a holder starts: after the steps the row has recorded.
    fn resume_phase(&self) -> Phase {
        match (self.final_step, self.charge_step) {
            (Some(done), _) => Phase::Complete(done.value),
            (None, Some(charged)) => Phase::Final(charged.value),
            (None, None) => Phase::Charge,
        }
    }

    /// The row leaves `Pending`: its steps go with it.
    fn settle(&mut self, row: Row) {
        self.row = row;
        self.charge_step = None;
        self.final_step = None;
    }

    fn ended(&self) -> bool {
        matches!(self.row, Row::Done { .. }) || (self.row == Row::GaveUp && !self.hook_owed)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gateway {
    Charged,
    FailedBeforeCharging,
    /// The charge was made but the response was lost.
    FailedAfterCharging,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Tick,
    Claim(usize),
    CallGateway(usize, Gateway),
    Release(usize),
    RecordCharge(usize),
    FinalPhase(usize),
    Complete(usize),
    Renew(usize),
    GiveUp(usize),
    RunHook(usize),
    ClearHook(usize),
    Crash { who: usize, restart: bool },
}

impl Model for Protocol {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        vec![World {
            row: Row::Absent,
            charge_step: None,
            final_step: None,
            payments: Vec::new(),
            charges: Vec::new(),
            gateway_calls: 0,
            hook_owed: false,
            hook_runs: 0,
            give_ups: 0,
            crashes_left: self.crash_budget,
            slow_ticks_left: self.slow_ticks,
            holder_crashed: false,
            taken_over_after_crash: false,
            zombie_fenced: false,
            processes: vec![Local::Ready; self.clients + self.completers],
        }]
    }

    fn actions(&self, w: &World, actions: &mut Vec<Action>) {
        if let Row::Pending {
            token, lease_left, ..
        } = w.row
            && lease_left > 0
            && (w.slow_ticks_left > 0 || !w.holder_alive(token))
        {
            actions.push(Action::Tick);
        }
        for (who, local) in w.processes.iter().enumerate() {
            match *local {
                Local::Ready if self.is_client(who) => actions.push(Action::Claim(who)),
                Local::Ready => {
                    if let Row::Pending {
                        lease_left: 0,
                        attempts,
                        ..
                    } = w.row
                    {
                        let exhausted = attempts >= MAX_ATTEMPTS && w.final_step.is_none();
                        actions.push(if self.give_up && exhausted {
                            Action::GiveUp(who)
                        } else {
                            Action::Claim(who)
                        });
                    }
                    if w.hook_owed {
                        actions.push(Action::RunHook(who));
                    }
                }
                Local::RanHook => actions.push(Action::ClearHook(who)),
                Local::Holding { token, phase } => {
                    actions.extend(match phase {
                        Phase::Charge if self.gateway_always_fails => vec![
                            Action::CallGateway(who, Gateway::FailedBeforeCharging),
                            Action::CallGateway(who, Gateway::FailedAfterCharging),
                        ],
                        Phase::Charge => vec![
                            Action::CallGateway(who, Gateway::Charged),
                            Action::CallGateway(who, Gateway::FailedBeforeCharging),
                            Action::CallGateway(who, Gateway::FailedAfterCharging),
                        ],
                        Phase::Release => vec![Action::Release(who)],
                        Phase::RecordCharge(_) => vec![Action::RecordCharge(who)],
                        Phase::Final(_) => vec![Action::FinalPhase(who)],
                        Phase::Complete(_) => vec![Action::Complete(who)],
                    });
                    // The renewal task runs while the body does, and only extends a held lease.
                    let body_running = !matches!(phase, Phase::Release | Phase::Complete(_));
                    if body_running
                        && matches!(w.row, Row::Pending { token: t, lease_left, .. }
                            if t == token && lease_left < LEASE_TICKS)
                    {
                        actions.push(Action::Renew(who));
                    }
                }
                Local::Answered(_) | Local::Gone => {}
            }
            let busy = matches!(local, Local::Holding { .. } | Local::RanHook);
            if busy && w.crashes_left > 0 {
                actions.push(Action::Crash {
                    who,
                    restart: true,
                });
                if self.is_client(who) {
                    actions.push(Action::Crash {
                        who,
                        restart: false,
                    });
                }
            }
        }
    }

    fn next_state(&self, last: &World, action: Action) -> Option<World> {
        let mut w = last.clone();
        match action {
            Action::Tick => {
                if let Row::Pending {
                    token,
                    ref mut lease_left,
                    ..
                } = w.row
                {
                    *lease_left -= 1;
                    if last.holder_alive(token) {
                        w.slow_ticks_left -= 1;
                    }
                }
            }
            Action::Claim(who) => self.claim(&mut w, who),
            Action::CallGateway(who, outcome) => {
                let Local::Holding { token, .. } = w.processes[who] else {
                    return None;
                };
                w.gateway_calls += 1;
                let key = if self.key_per_attempt { token + 1 } else { 0 };
                let charge = if outcome == Gateway::FailedBeforeCharging {
                    None
                } else if let Some(found) = w.charges.iter().position(|k| *k == key) {
                    Some(found as ChargeId)
                } else {
                    w.charges.push(key);
                    Some((w.charges.len() - 1) as ChargeId)
                };
                let phase = match (outcome, charge) {
                    (Gateway::Charged, Some(charge)) => Phase::RecordCharge(charge),
                    _ => Phase::Release,
                };
                w.processes[who] = Local::Holding { token, phase };
            }
            Action::Release(who) => {
                let Local::Holding { token, .. } = w.processes[who] else {
                    return None;
                };
                // `release_lease` is fenced by the token in every variant.
                if let Row::Pending {
                    token: current,
                    ref mut lease_left,
                    ..
                } = w.row
                    && current == token
                {
                    *lease_left = 0;
                }
                self.stop(&mut w, who, Answer::Failed);
            }
            Action::RecordCharge(who) | Action::FinalPhase(who) | Action::Complete(who) => {
                let Local::Holding { token, phase } = w.processes[who] else {
                    return None;
                };
                if !self.fenced(&w.row, token) {
                    w.zombie_fenced = true;
                    self.stop(&mut w, who, Answer::LeaseLost);
                    return Some(w);
                }
                match phase {
                    Phase::RecordCharge(charge) => {
                        w.charge_step = Some(Step {
                            value: charge,
                            token,
                        });
                        w.processes[who] = Local::Holding {
                            token,
                            phase: Phase::Final(charge),
                        };
                    }
                    Phase::Final(charge) => {
                        w.payments.push(charge);
                        w.final_step = Some(Step {
                            value: charge,
                            token,
                        });
                        if self.final_completes {
                            w.settle(Row::Done { answer: charge });
                            self.stop(&mut w, who, Answer::Paid(charge));
                        } else {
                            w.processes[who] = Local::Holding {
                                token,
                                phase: Phase::Complete(charge),
                            };
                        }
                    }
                    Phase::Complete(answer) => {
                        w.settle(Row::Done { answer });
                        self.stop(&mut w, who, Answer::Paid(answer));
                    }
                    Phase::Charge | Phase::Release => return None,
                }
            }
            Action::Renew(_) => {
                if let Row::Pending {
                    ref mut lease_left, ..
                } = w.row
                {
                    *lease_left = LEASE_TICKS;
                }
            }
            Action::GiveUp(_) => {
                // The real transaction bumps the token; leaving `Pending` fences all the same.
                w.settle(Row::GaveUp);
                w.hook_owed = true;
                w.give_ups += 1;
            }
            Action::RunHook(who) => {
                w.hook_runs = (w.hook_runs + 1).min(2);
                w.processes[who] = Local::RanHook;
            }
            Action::ClearHook(who) => {
                w.hook_owed = false;
                w.processes[who] = Local::Ready;
            }
            Action::Crash { who, restart } => {
                if let (Local::Holding { token, .. }, Row::Pending { token: current, .. }) =
                    (w.processes[who], &w.row)
                    && token == *current
                {
                    w.holder_crashed = true;
                }
                w.crashes_left -= 1;
                w.processes[who] = if restart { Local::Ready } else { Local::Gone };
            }
        }
        Some(w)
    }

    fn within_boundary(&self, w: &World) -> bool {
        !matches!(w.row, Row::Pending { attempts, .. } if attempts > ATTEMPT_BOUND)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_PAYMENT, |_, w: &World| w.payments.len() <= 1),
            Property::always(ONE_CHARGE, |_, w: &World| w.charges.len() <= 1),
            Property::always(DONE_PAID_ONCE, |_, w: &World| match w.row {
                Row::Done { answer } => w.payments == [answer] && w.charges.len() == 1,
                _ => true,
            }),
            Property::always(GAVE_UP_UNPAID, |_, w: &World| {
                w.row != Row::GaveUp || w.payments.is_empty()
            }),
            Property::always(ONE_GIVE_UP, |_, w: &World| w.give_ups <= 1),
            Property::always(HOOK_RAN, |_, w: &World| {
                w.row != Row::GaveUp || w.hook_owed || w.hook_runs >= 1
            }),
            Property::always(ANSWERS_RECORDED, |_, w: &World| {
                w.processes.iter().all(|p| match p {
                    Local::Answered(Answer::Paid(got)) => w.row == Row::Done { answer: *got },
                    _ => true,
                })
            }),
            Property::always(WITHIN_BOUND, |_, w: &World| {
                !matches!(w.row, Row::Pending { attempts, .. } if attempts >= ATTEMPT_BOUND)
            }),
            Property::eventually(CALL_ENDS, |_, w: &World| w.ended()),
            Property::sometimes(DONE_REACHABLE, |_, w: &World| {
                matches!(w.row, Row::Done { .. })
            }),
            Property::sometimes(GAVE_UP_REACHABLE, |_, w: &World| w.row == Row::GaveUp),
            Property::sometimes(TAKEOVER_AFTER_CRASH, |_, w: &World| w.taken_over_after_crash),
            Property::sometimes(ZOMBIE_FENCED, |_, w: &World| w.zombie_fenced),
        ]
    }
}

impl Protocol {
    /// One claim transaction, by a client (`claim_lease`) or a completer (a takeover).
    fn claim(&self, w: &mut World, who: usize) {
        let client = self.is_client(who);
        match w.row {
            Row::Absent => {
                w.row = Row::Pending {
                    token: 0,
                    lease_left: LEASE_TICKS,
                    attempts: 0,
                };
                w.processes[who] = Local::Holding {
                    token: 0,
                    phase: Phase::Charge,
                };
            }
            Row::Pending { lease_left, .. } if lease_left > 0 => {
                w.processes[who] = Local::Answered(Answer::InFlight);
            }
            Row::Pending {
                token, attempts, ..
            } => {
                w.taken_over_after_crash |= w.holder_crashed;
                w.holder_crashed = false;
                w.row = Row::Pending {
                    token: token + 1,
                    lease_left: LEASE_TICKS,
                    attempts: if client { attempts } else { attempts + 1 },
                };
                w.processes[who] = Local::Holding {
                    token: token + 1,
                    phase: w.resume_phase(),
                };
            }
            Row::Done { answer } => {
                w.processes[who] = Local::Answered(Answer::Paid(answer));
            }
            Row::GaveUp => w.processes[who] = Local::Answered(Answer::GaveUp),
        }
    }

    /// A holder stops: a client answers, a completer goes back to polling.
    fn stop(&self, w: &mut World, who: usize, answer: Answer) {
        w.processes[who] = if self.is_client(who) {
            Local::Answered(answer)
        } else {
            Local::Ready
        };
    }
}

/// Checks `protocol` to the end (or until `stop_at` is discovered) and prints the figures.
fn check(name: &str, protocol: Protocol, stop_at: Option<&'static str>) -> impl Checker<Protocol> {
    let started = Instant::now();
    let mut builder = protocol.checker();
    if let Some(property) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])));
    }
    let checker = builder.spawn_bfs().join();
    println!(
        "{name}: {} unique states ({} generated), max depth {}, {:.1?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed(),
    );
    checker
}

/// Asserts that `property` has a counterexample once a guard is removed, and prints it.
fn expect_counterexample(name: &str, protocol: Protocol, property: &'static str) {
    let checker = check(name, protocol, Some(property));
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("{name}: no counterexample to {property:?}"));
    let last = path.last_state().clone();
    let actions = path.into_actions();
    println!(
        "{name}: {property:?} fails after {} actions: {actions:?}\nlast state: {last:?}",
        actions.len()
    );
}

#[test]
fn the_guarded_protocol_keeps_every_promise() {
    check("guarded", Protocol::guarded(), None).assert_properties();
}

#[test]
fn folding_the_final_phase_into_completion_keeps_every_promise() {
    let protocol = Protocol {
        final_completes: true,
        ..Protocol::guarded()
    };
    check("final phase completes", protocol, None).assert_properties();
}

#[test]
fn a_gateway_that_always_fails_ends_in_a_give_up() {
    let protocol = Protocol {
        gateway_always_fails: true,
        ..Protocol::guarded()
    };
    let checker = check("gateway always fails", protocol, None);
    for property in checker.model().properties() {
        match property.expectation {
            _ if property.name == DONE_REACHABLE => {
                assert!(checker.discovery(DONE_REACHABLE).is_none(), "nothing was charged");
            }
            Expectation::Sometimes => drop(checker.assert_any_discovery(property.name)),
            Expectation::Always | Expectation::Eventually => {
                checker.assert_no_discovery(property.name);
            }
        }
    }
}

#[test]
fn without_the_fence_a_zombie_pays_twice() {
    let protocol = Protocol {
        fence: false,
        ..Protocol::guarded()
    };
    expect_counterexample("no fence", protocol, ONE_PAYMENT);
}

#[test]
fn without_the_give_up_a_failing_call_never_ends() {
    let protocol = Protocol {
        give_up: false,
        gateway_always_fails: true,
        ..Protocol::guarded()
    };
    expect_counterexample("no give-up", protocol, CALL_ENDS);
}

#[test]
fn without_completers_an_abandoned_call_never_ends() {
    let protocol = Protocol {
        completers: 0,
        ..Protocol::guarded()
    };
    expect_counterexample("no completer", protocol, CALL_ENDS);
}

#[test]
fn a_gateway_key_per_attempt_charges_twice() {
    let protocol = Protocol {
        key_per_attempt: true,
        ..Protocol::guarded()
    };
    expect_counterexample("key per attempt", protocol, ONE_CHARGE);
}
