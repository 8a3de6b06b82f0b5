//! A model-checked specification (stateright) of idem's lease protocol for one idempotency key:
//! claim, fencing token, recorded steps, completer and give-up.
//!
//! One ledger row (`Absent`, `Pending(lease)`, `Done(answer)`, `GaveUp`) and its steps (`charge`,
//! `final`: value and writer's token; deleted when the row leaves `Pending`). The handler charges
//! a payment gateway that deduplicates by a key derived from the idempotency key and the step
//! name (Stripe-style), then its final phase inserts the `payment` row. Processes crash between
//! any two of their transactions, losing their local state. Clients (a request and its retry)
//! claim, then run the handler or get the recorded answer, `InFlight` or the give-up; a crashed
//! client comes back as a fresh one, or never. Completers take over `Pending` rows whose lease
//! ended as a retry would, counting an attempt; from `MAX_ATTEMPTS` on they give up instead (one
//! transaction: the row leaves `Pending`, fencing out every holder, and the hook is owed), then
//! run the hook and clear the flag (a crash in between runs it again); they restart after a
//! crash. A holder's writes commit only while the row is `Pending` under its token (the fence);
//! a takeover bumps the token and replays the recorded steps. A gateway failure (before the
//! charge, or after it with the response lost) releases the lease, fenced, and stops the holder.
//!
//! Decision: a call whose final phase committed is not given up, so a `GaveUp` row never has a
//! payment; it may have a charge (made, never paid for), which is what the give-up hook is for.
//! With a final phase that also completes the call (`final_completes`: `finish`), no such call is
//! `Pending`, and the give-up needs no check. With a separate completion (`final_step`), the
//! completer must complete such a call from its steps whatever its attempts: a give-up that does
//! not check (`give_up_after_final`) leaves a paid call given up.
//!
//! Mapping: `claim` (takeover, `InFlight`), `record_step` and `fence`, `final_step` (fence,
//! payment and step in one transaction), `complete` (`WHERE owner = ? AND state = 0`, steps
//! deleted), `release_lease`, `renew` in idem-sea-orm/src/lease.rs, driven by `run_lease` and
//! `step` in idem-core/src/lease/mod.rs; `finish` is the final phase that completes. Completer:
//! `idem::sea_orm::Completer` (idem-core/src/completer.rs `run_once`, `give_up`, `run_hook`;
//! idem-sea-orm/src/completer.rs `begin_attempt`, `give_up`, `forget`), which rebuilds the call
//! from the arguments stored with its claim. It counts an attempt in a transaction of its own
//! before the takeover; the model counts it in the takeover (a crash in between only makes the
//! real give-up come sooner, under the same guards).
//!
//! Purge (`purge_expired`, idem-sea-orm/src/lib.rs, statement `Sql::purge`): an operator's
//! action possible at any step, under a rule (`PurgeRule`). Today's rule (`Ended`) deletes a
//! row only when it ended (`Done`, or `GaveUp` with no hook owed) and its TTL passed; the rule
//! before it (`Expired`) deleted every row whose `expires_at_ms` passed, which for a `Pending`
//! row is its lease end, with the row's steps and stored call (the owed hook's flag with it).
//! The TTL is abstracted as the end of the retry window: an ended row is purged only once every
//! client has its answer or is gone (a retry after the TTL runs anew by contract). A row purged
//! leaves a ghost (`World::purged`) so the properties still speak of the record a client got;
//! a claim after a purge gets a fresh token (the real one is random).
//!
//! Abstracted: one key, one handler; no fingerprint or `wait` polling (`InFlight` is
//! final: the second client is the retry). The row keeps what the protocol compares, the lease's
//! ticks left (`lease_end - now` on the database clock), so time needs no horizon: `Tick` runs
//! while a lease is live. A tick while the holder is alive means it is slow; slow ticks, crashes
//! and a completer's attempts (`Protocol::attempt_bound`) are bounded.
//!
//! The guarded protocol purges under today's rule, so every check of it includes the purge;
//! the mutation tests run the rule before it and find the promises it broke.
//!
//! Properties (`Protocol::properties`): always at most one payment row and one charge; a `Done`
//! call has one payment, of the one charge, as its answer; a `GaveUp` call has no payment; one
//! give-up at most, its hook run before its flag is cleared; every answer a client got is the
//! recorded one. Eventually every call ends (`Done`, or `GaveUp` with its hook run). Stateright
//! checks `eventually` at terminal states only: the state graph has no cycle (`assert_acyclic`)
//! and "ended" stays true once true, so that covers every run. Sometimes: done, given up, a
//! crashed holder taken over, a zombie fenced out, a record purged (not vacuous). Each mutation
//! test removes one guard and expects the property it keeps to fail.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use stateright::{Checker, Expectation, HasDiscoveries, Model, Path, Property};

/// Clients: a request and its retry. They come first in `World::processes`, completers after.
const CLIENTS: usize = 2;
/// Length of a lease, in ticks.
const LEASE_TICKS: u8 = 2;
/// A completer gives up an ended lease once this many completer attempts were made.
const MAX_ATTEMPTS: u8 = 2;

const ONE_PAYMENT: &str = "at most one payment row";
const ONE_CHARGE: &str = "at most one charge at the gateway";
const GAVE_UP_UNPAID: &str = "a GaveUp call has no payment";
const CALL_ENDS: &str = "every call ends";
const DONE_REACHABLE: &str = "a call can be done";
const PURGED: &str = "a record can be purged";
const HOOK_RUN: &str = "a give-up's hook has run once its flag is cleared";

/// Which rows an operator's purge deletes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum PurgeRule {
    /// No purge runs.
    #[default]
    Never,
    /// Rows that ended (`Done`, `GaveUp` with no hook owed) past their TTL: today's rule.
    Ended,
    /// Every row whose `expires_at_ms` passed: past its TTL, or `Pending` with its lease
    /// ended; with its steps and stored call (the rule before issue 29).
    Expired,
}

type Token = u8;
/// A charge is named by its position in the gateway's list.
type ChargeId = u8;

/// The variant to check: size, budgets, and the changes (all off in the guarded protocol).
#[derive(Clone, Debug, Default)]
struct Protocol {
    completers: usize,
    crash_budget: u8,
    slow_ticks: u8,
    /// Step, final phase and completion check only that the row is `Pending`, not the token.
    unfenced: bool,
    /// Completers never give up: they retry forever.
    never_give_up: bool,
    /// Completers also give up a call whose final phase committed (the decision undone).
    give_up_after_final: bool,
    /// Every gateway call fails for this key.
    gateway_always_fails: bool,
    /// The gateway key is derived per attempt (from the token), not per step.
    key_per_attempt: bool,
    /// The final phase also completes the call (one transaction instead of two).
    final_completes: bool,
    /// What an operator's purge deletes.
    purge: PurgeRule,
}

impl Protocol {
    fn guarded() -> Self {
        Self {
            completers: 2,
            crash_budget: 3,
            // Enough for two live holders to lose their lease (two zombies).
            slow_ticks: 2 * LEASE_TICKS,
            purge: PurgeRule::Ended,
            ..Self::default()
        }
    }

    /// Past `MAX_ATTEMPTS`, a completer claims only a call whose final phase committed, once its
    /// holder's lease ended without a release: after a crash or `LEASE_TICKS` slow ticks. So the
    /// guarded protocol stays below this bound; the checker goes no further (`within_boundary`),
    /// and a path cut there stands for one that retries forever.
    fn attempt_bound(&self) -> u8 {
        MAX_ATTEMPTS + self.crash_budget + self.slow_ticks / LEASE_TICKS + 1
    }

    /// The fence of a holder's step, final phase and completion.
    fn fenced(&self, row: &Row, token: Token) -> bool {
        matches!(row, Row::Pending(lease) if self.unfenced || lease.token == token)
    }

    /// A holder stops: a client answers, a completer goes back to polling.
    fn stop(&self, w: &mut World, who: usize, answer: Answer) {
        w.processes[who] = if who < CLIENTS {
            Local::Answered(answer)
        } else {
            Local::Ready
        };
    }

    /// Whether the purge may delete the row now, under the protocol's rule.
    fn purgeable(&self, w: &World) -> bool {
        // The TTL passed: no client will retry within it.
        let ttl_passed = w.processes[..CLIENTS]
            .iter()
            .all(|p| matches!(p, Local::Answered(_) | Local::Gone));
        match (self.purge, w.row) {
            (PurgeRule::Never, _) | (_, Row::Absent) => false,
            (PurgeRule::Ended, Row::Done(_)) => ttl_passed,
            (PurgeRule::Ended, Row::GaveUp) => ttl_passed && !w.hook_owed,
            (PurgeRule::Ended, Row::Pending(_)) => false,
            (PurgeRule::Expired, Row::Done(_) | Row::GaveUp) => ttl_passed,
            (PurgeRule::Expired, Row::Pending(lease)) => lease.ticks_left == 0,
        }
    }

    /// One claim transaction, by a client (`claim_lease`) or a completer (a takeover).
    fn claim(&self, w: &mut World, who: usize) {
        w.processes[who] = match w.row {
            Row::Absent => {
                let lease = Lease {
                    token: w.next_token,
                    ticks_left: LEASE_TICKS,
                    attempts: 0,
                };
                w.row = Row::Pending(lease);
                Local::Holding(lease.token, Phase::Charge)
            }
            Row::Pending(lease) if lease.ticks_left > 0 => Local::Answered(Answer::InFlight),
            Row::Pending(lease) => {
                w.taken_over_after_crash |= w.holder_crashed;
                w.holder_crashed = false;
                let taken = Lease {
                    token: lease.token + 1,
                    ticks_left: LEASE_TICKS,
                    attempts: lease.attempts + u8::from(who >= CLIENTS),
                };
                w.row = Row::Pending(taken);
                Local::Holding(taken.token, w.resume_phase())
            }
            Row::Done(answer) => Local::Answered(Answer::Paid(answer)),
            Row::GaveUp => Local::Answered(Answer::GaveUp),
        };
    }
}

/// A `Pending` row: its holder's token, its lease, and the completers' attempts.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Lease {
    token: Token,
    ticks_left: u8,
    attempts: u8,
}

#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
enum Row {
    #[default]
    Absent,
    Pending(Lease),
    Done(ChargeId),
    GaveUp,
}

/// What a holder does next.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Charge,
    Release,
    RecordCharge(ChargeId),
    Final(ChargeId),
    Complete(ChargeId),
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Answer {
    Paid(ChargeId),
    InFlight,
    Failed,
    LeaseLost,
    GaveUp,
}

/// A process's local state (lost in a crash).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Local {
    /// A client about to submit; an idle completer.
    Ready,
    Holding(Token, Phase),
    /// A completer ran the give-up hook and has not cleared the flag yet.
    RanHook,
    Answered(Answer),
    /// A client that crashed and never came back.
    Gone,
}

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
struct World {
    row: Row,
    /// Steps: (value, token that wrote it).
    charge_step: Option<(ChargeId, Token)>,
    final_step: Option<(ChargeId, Token)>,
    /// The final phase's effect: the charge each payment row references.
    payments: Vec<ChargeId>,
    /// The gateway's charges, by the key each was made with.
    charges: Vec<u8>,
    gateway_calls: u8,
    hook_owed: bool,
    hook_runs: u8,
    give_ups: u8,
    crashes_left: u8,
    slow_ticks_left: u8,
    processes: Vec<Local>,
    /// The last row the purge deleted (a ghost: what clients were answered from).
    purged: Option<Row>,
    /// The token a claim of an absent row gets: above every token of a purged row.
    next_token: Token,
    /// For the examples: the current holder crashed; its lease was taken over after a crash; a
    /// fenced write was refused.
    holder_crashed: bool,
    taken_over_after_crash: bool,
    zombie_fenced: bool,
}

impl World {
    fn holder_alive(&self, token: Token) -> bool {
        self.processes
            .iter()
            .any(|p| matches!(p, Local::Holding(t, _) if *t == token))
    }

    /// Where a holder starts: after the steps the row has recorded.
    fn resume_phase(&self) -> Phase {
        match (self.final_step, self.charge_step) {
            (Some((answer, _)), _) => Phase::Complete(answer),
            (None, Some((charge, _))) => Phase::Final(charge),
            (None, None) => Phase::Charge,
        }
    }

    /// The row leaves `Pending`: its steps go with it.
    fn settle(&mut self, row: Row) {
        self.row = row;
        self.charge_step = None;
        self.final_step = None;
    }

    /// The call's record: the row, or the row the purge deleted.
    fn record(&self) -> Row {
        match (self.row, self.purged) {
            (Row::Absent, Some(purged)) => purged,
            (row, _) => row,
        }
    }

    fn ended(&self) -> bool {
        let record = self.record();
        matches!(record, Row::Done(_)) || (record == Row::GaveUp && !self.hook_owed)
    }

    /// The state with each role's processes sorted: processes of a role are interchangeable, so
    /// the checker visits one state of each such class (symmetry reduction).
    fn representative(&self) -> World {
        let mut canonical = self.clone();
        let (clients, completers) = canonical.processes.split_at_mut(CLIENTS);
        clients.sort_unstable();
        completers.sort_unstable();
        canonical
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Tick,
    Claim(usize),
    /// A gateway call: the charge made or not, the response received or lost.
    CallGateway {
        who: usize,
        charged: bool,
        answered: bool,
    },
    Release(usize),
    RecordCharge(usize),
    FinalPhase(usize),
    Complete(usize),
    Renew(usize),
    GiveUp(usize),
    RunHook(usize),
    ClearHook(usize),
    Crash {
        who: usize,
        restart: bool,
    },
    /// An operator's purge deletes the row.
    Purge,
}

impl Model for Protocol {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        vec![World {
            crashes_left: self.crash_budget,
            slow_ticks_left: self.slow_ticks,
            processes: vec![Local::Ready; CLIENTS + self.completers],
            ..World::default()
        }]
    }

    fn actions(&self, w: &World, actions: &mut Vec<Action>) {
        if self.purgeable(w) {
            actions.push(Action::Purge);
        }
        if let Row::Pending(lease) = w.row
            && lease.ticks_left > 0
            && (w.slow_ticks_left > 0 || !w.holder_alive(lease.token))
        {
            actions.push(Action::Tick);
        }
        for (who, local) in w.processes.iter().enumerate() {
            match *local {
                Local::Ready if who < CLIENTS => actions.push(Action::Claim(who)),
                Local::Ready => {
                    if let Row::Pending(lease) = w.row
                        && lease.ticks_left == 0
                    {
                        let finished = w.final_step.is_some() && !self.give_up_after_final;
                        let give_up =
                            !self.never_give_up && lease.attempts >= MAX_ATTEMPTS && !finished;
                        actions.push(if give_up {
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
                Local::Holding(token, phase) => {
                    match phase {
                        Phase::Charge => {
                            // Charged, failed before charging, failed after (the response lost);
                            // the variant whose gateway always fails skips the first.
                            let outcomes = [(true, true), (false, false), (true, false)];
                            let first = usize::from(self.gateway_always_fails);
                            actions.extend(outcomes[first..].iter().map(|&(charged, answered)| {
                                Action::CallGateway {
                                    who,
                                    charged,
                                    answered,
                                }
                            }));
                        }
                        Phase::Release => actions.push(Action::Release(who)),
                        Phase::RecordCharge(_) => actions.push(Action::RecordCharge(who)),
                        Phase::Final(_) => actions.push(Action::FinalPhase(who)),
                        Phase::Complete(_) => actions.push(Action::Complete(who)),
                    }
                    // The renewal task runs while the body does, and only extends a held lease.
                    let body_running = !matches!(phase, Phase::Release | Phase::Complete(_));
                    if body_running
                        && matches!(w.row, Row::Pending(lease)
                            if lease.token == token && lease.ticks_left < LEASE_TICKS)
                    {
                        actions.push(Action::Renew(who));
                    }
                }
                Local::Answered(_) | Local::Gone => {}
            }
            let busy = matches!(local, Local::Holding(..) | Local::RanHook);
            if busy && w.crashes_left > 0 {
                // A client may never come back; a completer is restarted.
                for restart in [true, false] {
                    if restart || who < CLIENTS {
                        actions.push(Action::Crash { who, restart });
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &World, action: Action) -> Option<World> {
        let mut w = last.clone();
        let holding = |who: usize| match last.processes[who] {
            Local::Holding(token, phase) => Some((token, phase)),
            _ => None,
        };
        match action {
            Action::Tick => {
                if let Row::Pending(lease) = &mut w.row {
                    lease.ticks_left -= 1;
                    if last.holder_alive(lease.token) {
                        w.slow_ticks_left -= 1;
                    }
                }
            }
            Action::Claim(who) => self.claim(&mut w, who),
            Action::CallGateway {
                who,
                charged,
                answered,
            } => {
                let (token, _) = holding(who)?;
                w.gateway_calls += 1;
                let key = if self.key_per_attempt { token + 1 } else { 0 };
                if charged && !w.charges.contains(&key) {
                    w.charges.push(key);
                }
                let charge = w.charges.iter().position(|k| *k == key);
                let phase = match charge {
                    Some(charge) if answered => Phase::RecordCharge(charge as ChargeId),
                    _ => Phase::Release,
                };
                w.processes[who] = Local::Holding(token, phase);
            }
            Action::Release(who) => {
                let (token, _) = holding(who)?;
                // `release_lease` checks the token in every variant.
                match &mut w.row {
                    Row::Pending(lease) if lease.token == token => lease.ticks_left = 0,
                    _ => w.zombie_fenced = true,
                }
                self.stop(&mut w, who, Answer::Failed);
            }
            Action::RecordCharge(who) | Action::FinalPhase(who) | Action::Complete(who) => {
                let (token, phase) = holding(who)?;
                if !self.fenced(&w.row, token) {
                    w.zombie_fenced = true;
                    self.stop(&mut w, who, Answer::LeaseLost);
                    return Some(w);
                }
                match phase {
                    Phase::RecordCharge(charge) => {
                        w.charge_step = Some((charge, token));
                        w.processes[who] = Local::Holding(token, Phase::Final(charge));
                    }
                    Phase::Final(charge) => {
                        w.payments.push(charge);
                        w.final_step = Some((charge, token));
                        w.processes[who] = Local::Holding(token, Phase::Complete(charge));
                        if self.final_completes {
                            w.settle(Row::Done(charge));
                            self.stop(&mut w, who, Answer::Paid(charge));
                        }
                    }
                    Phase::Complete(answer) => {
                        w.settle(Row::Done(answer));
                        self.stop(&mut w, who, Answer::Paid(answer));
                    }
                    Phase::Charge | Phase::Release => return None,
                }
            }
            Action::Renew(_) => {
                if let Row::Pending(lease) = &mut w.row {
                    lease.ticks_left = LEASE_TICKS;
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
                if let (Some((token, _)), Row::Pending(lease)) = (holding(who), w.row) {
                    w.holder_crashed |= token == lease.token;
                }
                w.crashes_left -= 1;
                w.processes[who] = if restart { Local::Ready } else { Local::Gone };
            }
            Action::Purge => {
                if let Row::Pending(lease) = w.row {
                    w.next_token = lease.token + 1;
                    // The stored call goes with the row: nothing is owed any more.
                    w.hook_owed = false;
                } else if self.purge == PurgeRule::Expired {
                    w.hook_owed = false;
                }
                w.purged = Some(w.row);
                w.settle(Row::Absent);
            }
        }
        Some(w)
    }

    fn within_boundary(&self, w: &World) -> bool {
        !matches!(w.row, Row::Pending(lease) if lease.attempts > self.attempt_bound())
    }

    fn properties(&self) -> Vec<Property<Self>> {
        type P = Property<Protocol>;
        vec![
            P::always(ONE_PAYMENT, |_, w| w.payments.len() <= 1),
            P::always(ONE_CHARGE, |_, w| w.charges.len() <= 1),
            P::always(
                "a Done call has one payment, of the one charge, as its answer",
                |_, w| match w.record() {
                    Row::Done(answer) => w.payments == [answer] && w.charges.len() == 1,
                    _ => true,
                },
            ),
            P::always(GAVE_UP_UNPAID, |_, w| {
                w.record() != Row::GaveUp || w.payments.is_empty()
            }),
            P::always("a give-up happens at most once", |_, w| w.give_ups <= 1),
            P::always(HOOK_RUN, |_, w| {
                w.record() != Row::GaveUp || w.hook_owed || w.hook_runs >= 1
            }),
            P::always("every answer a client got is the recorded one", |_, w| {
                w.processes.iter().all(|p| match p {
                    Local::Answered(Answer::Paid(got)) => w.record() == Row::Done(*got),
                    Local::Answered(Answer::GaveUp) => w.record() == Row::GaveUp,
                    _ => true,
                })
            }),
            P::always(
                "completer attempts stay below the model's bound",
                |m, w| !matches!(w.row, Row::Pending(lease) if lease.attempts >= m.attempt_bound()),
            ),
            P::eventually(CALL_ENDS, |_, w| w.ended()),
            P::sometimes(DONE_REACHABLE, |_, w| matches!(w.row, Row::Done(_))),
            P::sometimes("a call can be given up", |_, w| w.row == Row::GaveUp),
            P::sometimes("a crashed holder's lease can be taken over", |_, w| {
                w.taken_over_after_crash
            }),
            P::sometimes("a zombie holder can be fenced out", |_, w| w.zombie_fenced),
            P::sometimes(PURGED, |_, w| w.purged.is_some()),
        ]
    }
}

type Discoveries = HashMap<&'static str, Path<World, Action>>;

/// Runs the checker on `protocol` and prints the figures the team quotes: all of the state space,
/// depth first with symmetry reduction; or breadth first until a counterexample to `until`, so
/// that it is a shortest one.
fn check(name: &str, protocol: Protocol, until: Option<&'static str>) -> Discoveries {
    let started = Instant::now();
    let (discoveries, unique, generated) = match until {
        None => figures(
            &protocol
                .checker()
                .symmetry_fn(World::representative)
                .spawn_dfs()
                .join(),
        ),
        Some(property) => figures(
            &protocol
                .checker()
                .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
                .spawn_bfs()
                .join(),
        ),
    };
    let elapsed = started.elapsed();
    println!("{name}: {unique} unique states ({generated} generated) in {elapsed:.1?}");
    discoveries
}

fn figures(checker: &impl Checker<Protocol>) -> (Discoveries, usize, usize) {
    let states = (checker.unique_state_count(), checker.state_count());
    (checker.discoveries(), states.0, states.1)
}

fn describe(path: &Path<World, Action>) -> String {
    let (actions, last) = (path.clone().into_actions(), path.last_state());
    format!("{} actions: {actions:?}\nlast: {last:?}", actions.len())
}

/// Asserts no counterexample to any `always` or `eventually` property, and an example of each
/// `sometimes` property but those in `unreachable`, which must have none.
fn assert_promises_kept(name: &str, protocol: Protocol, unreachable: &[&str]) {
    let properties = protocol.properties();
    let discoveries = check(name, protocol, None);
    for property in properties {
        match (&property.expectation, discoveries.get(property.name)) {
            (Expectation::Sometimes, found) => assert_eq!(
                found.is_some(),
                !unreachable.contains(&property.name),
                "{name}: an example of {:?}",
                property.name
            ),
            (_, Some(path)) => panic!("{name}: {:?} fails after {}", property.name, describe(path)),
            (_, None) => {}
        }
    }
}

/// Asserts that `property` has a counterexample in `protocol`, and prints a shortest one.
fn expect_counterexample(name: &str, protocol: Protocol, property: &'static str) {
    let discoveries = check(name, protocol, Some(property));
    let path = discoveries
        .get(property)
        .unwrap_or_else(|| panic!("{name}: no counterexample to {property:?}"));
    println!("{name}: {property:?} fails after {}", describe(path));
}

/// `eventually` is checked at terminal states only, so a cycle could hide a run that never ends:
/// checks that the state graph has none (depth first: no successor is a state on the path).
fn assert_acyclic(protocol: &Protocol) {
    let successors = |w: &World| -> Vec<World> {
        let next = protocol.next_states(w).into_iter();
        next.filter(|n| protocol.within_boundary(n)).collect()
    };
    // A state maps to whether it is still on the current path.
    let mut on_path: HashMap<World, bool> = HashMap::new();
    let mut path: Vec<(World, Vec<World>)> = Vec::new();
    for init in protocol.init_states() {
        on_path.insert(init.representative(), true);
        path.push((init.clone(), successors(&init)));
        while let Some((state, next)) = path.last_mut() {
            let Some(next) = next.pop() else {
                on_path.insert(state.representative(), false);
                path.pop();
                continue;
            };
            let seen = on_path.get(&next.representative()).copied();
            assert_ne!(seen, Some(true), "a cycle through {next:?}");
            if seen.is_none() {
                on_path.insert(next.representative(), true);
                let after = successors(&next);
                path.push((next, after));
            }
        }
    }
    println!("acyclic: {} states", on_path.len());
}

/// The guarded protocol with one change.
fn mutated(change: impl FnOnce(&mut Protocol)) -> Protocol {
    let mut protocol = Protocol::guarded();
    change(&mut protocol);
    protocol
}

#[test]
fn the_guarded_protocol_keeps_every_promise() {
    assert_promises_kept("guarded", Protocol::guarded(), &[]);
}

#[test]
fn the_guarded_protocol_has_no_cycle() {
    assert_acyclic(&Protocol::guarded());
}

/// `finish` on main: no call is `Pending` with its final phase committed, so a give-up that does
/// not look at the steps (main's) is safe.
#[test]
fn a_final_phase_that_completes_keeps_every_promise_with_any_give_up() {
    let protocol = mutated(|p| (p.final_completes, p.give_up_after_final) = (true, true));
    assert_promises_kept("final phase completes", protocol, &[]);
}

#[test]
fn a_gateway_that_always_fails_ends_in_a_give_up() {
    let protocol = mutated(|p| p.gateway_always_fails = true);
    assert_promises_kept("gateway always fails", protocol, &[DONE_REACHABLE]);
}

#[test]
fn without_the_fence_a_zombie_pays_twice() {
    let protocol = mutated(|p| p.unfenced = true);
    expect_counterexample("no fence", protocol, ONE_PAYMENT);
}

/// The gateway's failures alone are enough; without crashes or slowness the attempt bound is low
/// and a shortest counterexample is short.
#[test]
fn without_the_give_up_a_failing_call_never_ends() {
    let protocol = mutated(|p| {
        (p.never_give_up, p.gateway_always_fails) = (true, true);
        (p.crash_budget, p.slow_ticks) = (0, 0);
    });
    expect_counterexample("no give-up", protocol, CALL_ENDS);
}

#[test]
fn giving_up_after_the_final_phase_leaves_a_paid_call_given_up() {
    let protocol = mutated(|p| p.give_up_after_final = true);
    expect_counterexample("give-up after final", protocol, GAVE_UP_UNPAID);
}

#[test]
fn without_completers_an_abandoned_call_never_ends() {
    let protocol = mutated(|p| p.completers = 0);
    expect_counterexample("no completer", protocol, CALL_ENDS);
}

#[test]
fn a_gateway_key_per_attempt_charges_twice() {
    let protocol = mutated(|p| p.key_per_attempt = true);
    expect_counterexample("key per attempt", protocol, ONE_CHARGE);
}

/// The purge before issue 29: a call whose lease ended, its final phase committed, is purged
/// with its steps; the client's retry claims the key anew and pays a second time.
#[test]
fn purging_expired_leases_pays_twice() {
    let protocol = mutated(|p| p.purge = PurgeRule::Expired);
    expect_counterexample("purge of expired leases", protocol, ONE_PAYMENT);
}

/// The same purge deletes a call abandoned by its client: the completer has nothing left to
/// finish, so the call never ends; and a give-up's owed hook is dropped unrun.
#[test]
fn purging_expired_leases_strands_calls_and_drops_owed_hooks() {
    let protocol = mutated(|p| {
        p.purge = PurgeRule::Expired;
        (p.crash_budget, p.slow_ticks) = (1, 0);
    });
    expect_counterexample("purge strands a call", protocol, CALL_ENDS);
    let protocol = mutated(|p| {
        (p.purge, p.gateway_always_fails) = (PurgeRule::Expired, true);
        (p.crash_budget, p.slow_ticks) = (0, 0);
    });
    expect_counterexample("purge drops a hook", protocol, HOOK_RUN);
}
