//! Declared state machines: the second line of defence behind the idempotency key.
//!
//! The key guards the gate (the same request twice); the transition guards the inside (two
//! different requests that both try to pay one order). Declare the transitions once on the
//! state enum with `#[derive(idem::StateMachine)]`; name one in a handler with
//! `idem::transition!(OrderStatus: Pending -> Paid)`, which fails to compile when the enum
//! does not declare it; apply it to a row with a guarded update (`idem::sea_orm::Stateful`).

use crate::error::Error;

/// A state enum with declared transitions. Derive it: `#[derive(idem::StateMachine)]` with
/// `#[transitions(Pending -> Paid, Pending -> Cancelled)]`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a state machine",
    label = "no declared transitions",
    note = "derive `idem::StateMachine` on the state enum and list its transitions: `#[transitions(Pending -> Paid, Paid -> Shipped)]`"
)]
pub trait StateMachine: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// Every state, in declaration order; the first is the initial state.
    const STATES: &'static [Self];
    /// Every declared `(from, to)` transition.
    const TRANSITIONS: &'static [(Self, Self)];
    /// The declared transitions as variant discriminants, for the compile-time check of
    /// `transition!` (const code cannot compare `Self` values). Written by the derive.
    #[doc(hidden)]
    const DECLARED: &'static [(i128, i128)];

    /// The state's name (the variant's identifier).
    fn name(self) -> &'static str;

    /// Whether `from -> to` is declared.
    fn allows(from: Self, to: Self) -> bool {
        Self::TRANSITIONS.contains(&(from, to))
    }

    /// The state diagram as Mermaid `stateDiagram-v2` text (for docs and READMEs).
    fn mermaid() -> String {
        let mut out = String::from("stateDiagram-v2\n");
        if let Some(first) = Self::STATES.first() {
            out.push_str(&format!("    [*] --> {}\n", first.name()));
        }
        for (from, to) in Self::TRANSITIONS {
            out.push_str(&format!("    {} --> {}\n", from.name(), to.name()));
        }
        for state in Self::STATES {
            if !Self::TRANSITIONS.iter().any(|(from, _)| from == state) {
                out.push_str(&format!("    {} --> [*]\n", state.name()));
            }
        }
        out
    }
}

/// Whether `S` declares the transition between the variants with discriminants `from` and
/// `to`: the compile-time check behind `transition!`.
#[doc(hidden)]
pub const fn declared<S: StateMachine>(from: i128, to: i128) -> bool {
    let mut i = 0;
    while i < S::DECLARED.len() {
        if S::DECLARED[i].0 == from && S::DECLARED[i].1 == to {
            return true;
        }
        i += 1;
    }
    false
}

/// A declared transition `from -> to` of `S`. Build it with `idem::transition!` (checked at
/// compile time) or [`Transition::new`] (checked at run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition<S> {
    from: S,
    to: S,
}

impl<S> Transition<S> {
    /// Used by `idem::transition!` after its compile-time check (which also checks that `S`
    /// is a state machine, so this needs no bound: one error, not two).
    #[doc(hidden)]
    pub const fn checked(from: S, to: S) -> Self {
        Self { from, to }
    }
}

impl<S: StateMachine> Transition<S> {
    /// `from -> to`, or [`Error::InvalidTransition`] when `S` does not declare it.
    pub fn new(from: S, to: S) -> Result<Self, Error> {
        if S::allows(from, to) {
            Ok(Self { from, to })
        } else {
            Err(invalid(from, to))
        }
    }

    /// The state the row must be in.
    pub fn from(self) -> S {
        self.from
    }

    /// The state the row moves to.
    pub fn to(self) -> S {
        self.to
    }

    /// What applying this transition to a row in state `current` does, without writing:
    /// `Applied` if `current` is `from`, `AlreadyApplied` if it is `to`, else an error.
    pub fn classify(self, current: S) -> Result<TransitionOutcome, Error> {
        if current == self.to {
            Ok(TransitionOutcome::AlreadyApplied)
        } else if current == self.from {
            Ok(TransitionOutcome::Applied)
        } else {
            // Inside an idempotent call this lands in its span, next to scope and key hash.
            tracing::info!(
                outcome = "invalid_transition",
                from = current.name(),
                to = self.to.name(),
                "transition refused"
            );
            Err(invalid(current, self.to))
        }
    }
}

impl<S: StateMachine> Transition<S> {
    /// What a guarded update (`UPDATE … SET state = to WHERE id = ? AND state = from`) that
    /// changed no row means, from the row's state read under lock after it (`None`: no such
    /// row): [`TransitionOutcome::NotFound`], [`TransitionOutcome::AlreadyApplied`] for a row
    /// already in `to`, [`Error::InvalidTransition`] for a row in another state. A row in
    /// `from` changed while the update ran: an [`Error::Store`] (retry). Every store's guarded
    /// transition ends with it.
    pub fn unchanged_row(self, current: Option<S>) -> Result<TransitionOutcome, Error> {
        let Some(current) = current else {
            return Ok(TransitionOutcome::NotFound);
        };
        match self.classify(current)? {
            TransitionOutcome::Applied => Err(Error::Store {
                message: "the row's state changed during the transition; retry".to_owned(),
                source: None,
            }),
            outcome => Ok(outcome),
        }
    }
}

fn invalid<S: StateMachine>(from: S, to: S) -> Error {
    Error::InvalidTransition {
        from: from.name().to_owned(),
        to: to.name().to_owned(),
    }
}

/// What applying a transition to a row did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "a transition may not have been applied: check for `Applied`"]
pub enum TransitionOutcome {
    /// The row was in `from` and is now in `to`.
    Applied,
    /// The row was already in `to`: nothing written (the "already paid" success).
    AlreadyApplied,
    /// No row has that id: nothing written.
    NotFound,
}

impl TransitionOutcome {
    /// `true` when this call moved the row.
    pub const fn is_applied(self) -> bool {
        matches!(self, Self::Applied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum S {
        Pending,
        Paid,
        Cancelled,
    }

    impl StateMachine for S {
        const STATES: &'static [Self] = &[S::Pending, S::Paid, S::Cancelled];
        const TRANSITIONS: &'static [(Self, Self)] =
            &[(S::Pending, S::Paid), (S::Pending, S::Cancelled)];
        const DECLARED: &'static [(i128, i128)] = &[(0, 1), (0, 2)];
        fn name(self) -> &'static str {
            match self {
                S::Pending => "Pending",
                S::Paid => "Paid",
                S::Cancelled => "Cancelled",
            }
        }
    }

    #[test]
    fn classifies_like_the_seeds() {
        let pay = Transition::new(S::Pending, S::Paid).unwrap();
        assert_eq!(
            pay.classify(S::Pending).unwrap(),
            TransitionOutcome::Applied
        );
        assert_eq!(
            pay.classify(S::Paid).unwrap(),
            TransitionOutcome::AlreadyApplied
        );
        let err = pay.classify(S::Cancelled).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid state transition from `Cancelled` to `Paid`"
        );
        assert!(Transition::new(S::Cancelled, S::Paid).is_err());
    }

    #[test]
    fn an_unchanged_row_is_settled_by_its_state() {
        let pay = Transition::new(S::Pending, S::Paid).unwrap();
        assert_eq!(
            pay.unchanged_row(None).unwrap(),
            TransitionOutcome::NotFound
        );
        assert_eq!(
            pay.unchanged_row(Some(S::Paid)).unwrap(),
            TransitionOutcome::AlreadyApplied
        );
        assert!(matches!(
            pay.unchanged_row(Some(S::Cancelled)),
            Err(Error::InvalidTransition { .. })
        ));
        assert!(matches!(
            pay.unchanged_row(Some(S::Pending)),
            Err(Error::Store { .. })
        ));
    }

    #[test]
    fn mermaid_lists_start_transitions_and_ends() {
        let m = S::mermaid();
        assert!(m.starts_with("stateDiagram-v2\n    [*] --> Pending\n"));
        assert!(m.contains("    Pending --> Cancelled\n"));
        assert!(m.contains("    Paid --> [*]\n") && m.contains("    Cancelled --> [*]\n"));
    }
}
