//! What a handler must be for `#[idempotent]`: its return type (`Result<T, E>` with a
//! recordable `T` and an `E` that carries idem's errors), fingerprintable arguments, and which
//! of its errors are final (recorded and replayed) rather than transient (the key is freed).

use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::Error;
use crate::ledger::RecordStatus;

/// The return type of a handler: `Result<T, E>`.
pub trait HandlerOutput: Sized {
    /// The success type, recorded and replayed.
    type Ok;
    /// The handler's error type.
    type Error;
    /// Splits into a `Result`.
    fn into_result(self) -> Result<Self::Ok, Self::Error>;
    /// Builds from a `Result`.
    fn from_result(result: Result<Self::Ok, Self::Error>) -> Self;
}

impl<T, E> HandlerOutput for Result<T, E> {
    type Ok = T;
    type Error = E;
    fn into_result(self) -> Self {
        self
    }
    fn from_result(result: Self) -> Self {
        result
    }
}

/// A value `#[idempotent]` can record and replay: anything serde can write and read back.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be recorded and replayed by `#[idempotent]`",
    label = "the `Ok` type of this return type must be recordable",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}`"
)]
pub trait Replayable: Serialize + DeserializeOwned {}
#[diagnostic::do_not_recommend] // report `T: Replayable` (with its note), not each serde trait
impl<T: Serialize + DeserializeOwned> Replayable for T {}

/// The error type of an `#[idempotent]` handler: it must absorb idem's own errors.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry idem's errors",
    label = "the error type of this return type needs `From<idem::Error>`",
    note = "add `impl From<idem::Error> for {Self}` (for example a `#[error(transparent)] Idem(#[from] idem::Error)` variant)"
)]
pub trait HandlerError: From<Error> {}
#[diagnostic::do_not_recommend] // report `E: HandlerError` (with its note), not `From`
impl<E: From<Error>> HandlerError for E {}

/// An argument `#[idempotent]` can fingerprint: anything serde can write.
#[diagnostic::on_unimplemented(
    message = "argument of type `{Self}` cannot be fingerprinted by `#[idempotent]`",
    label = "this argument goes into the fingerprint",
    note = "derive `serde::Serialize` for `{Self}`, or leave the argument out of the fingerprint with `skip(<name>)`"
)]
pub trait Fingerprintable: Serialize {}
#[diagnostic::do_not_recommend] // report `T: Fingerprintable` (with its note), not `Serialize`
impl<T: Serialize + ?Sized> Fingerprintable for T {}

/// An argument of a resumable handler (`#[idempotent(..., lease, resumable)]`): stored with
/// the claim as JSON and read back by a completer that rebuilds the call, so serde must
/// write it and read it back into an owned value.
#[diagnostic::on_unimplemented(
    message = "argument of type `{Self}` cannot be stored for a resumable call",
    label = "a completer rebuilds the call from this argument",
    note = "derive `serde::Serialize` and `serde::Deserialize` for an owned type (`String`, not `&str`), or leave the argument out with `skip(<name>)` and supply it in the completer's resumer"
)]
pub trait StoredArgument: Serialize + DeserializeOwned {}
#[diagnostic::do_not_recommend] // report `T: StoredArgument` (with its note), not each serde trait
impl<T: Serialize + DeserializeOwned> StoredArgument for T {}

/// An error type whose deterministic failures (card declined, invalid transition) are
/// recorded and replayed like results, instead of releasing the key.
///
/// Without this impl every `Err` releases the key, so a retry executes again. With it,
/// errors for which [`is_final`](FinalError::is_final) is `true` roll back the handler's
/// writes but commit the recorded error; a retry gets the same error back.
pub trait FinalError: Serialize + DeserializeOwned {
    /// Whether this error is deterministic: retrying the same request would fail the same way.
    fn is_final(&self) -> bool;
}

/// How the engine treats a handler's errors; built by [`FinalProbe`].
#[derive(Debug)]
pub struct Finality<E> {
    pub(crate) is_final: fn(&E) -> bool,
    pub(crate) encode: fn(&E) -> serde_json::Result<Vec<u8>>,
    pub(crate) decode: fn(&[u8]) -> serde_json::Result<E>,
}

impl<E> Clone for Finality<E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Finality<E> {}

impl<E: FinalError> Finality<E> {
    fn of() -> Self {
        Self {
            is_final: E::is_final,
            encode: |e| serde_json::to_vec(e),
            decode: |bytes| serde_json::from_slice(bytes),
        }
    }
}

/// Chooses [`Finality`] by whether `E: FinalError` (autoref specialisation: the generated
/// code calls `(&&FinalProbe::<E>::new()).finality()`).
#[derive(Debug)]
pub struct FinalProbe<E>(PhantomData<fn() -> E>);

impl<E> FinalProbe<E> {
    /// A probe for `E`.
    #[allow(clippy::new_without_default)] // only the generated code builds probes
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

/// Chosen when `E: FinalError`.
pub trait ViaFinal<E> {
    /// `Some` for error types that can be final.
    fn finality(&self) -> Option<Finality<E>>;
}
impl<E: FinalError> ViaFinal<E> for &FinalProbe<E> {
    fn finality(&self) -> Option<Finality<E>> {
        Some(Finality::of())
    }
}

/// Chosen for every other error type.
pub trait ViaPlain<E> {
    /// `None`: every error releases the key.
    fn finality(&self) -> Option<Finality<E>>;
}
impl<E> ViaPlain<E> for FinalProbe<E> {
    fn finality(&self) -> Option<Finality<E>> {
        None
    }
}

/// An argument of a handler, kept so that every try of its body gets one: a try the database
/// aborts for a conflict (atomic mode's claim transaction, lease mode's final phase kept open
/// for the result) is run again ([`conflict`](crate::retry::conflict)). The
/// generated code takes it out with `(&&RerunProbe(&arg)).next_try(scope)?` for each try that
/// executes (a replay takes nothing): a `Clone` argument (references are) is cloned; any other
/// is moved into the first try, and a second try is refused with a conflict that names it.
pub struct Rerun<T> {
    slot: std::sync::Mutex<Option<T>>,
    /// The parameter's name, for the error of a try that cannot have it.
    name: &'static str,
}

impl<T> std::fmt::Debug for Rerun<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rerun")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<T> Rerun<T> {
    /// Keeps `value`, the argument of parameter `name`, for the tries of a call.
    pub const fn new(value: T, name: &'static str) -> Self {
        Self {
            slot: std::sync::Mutex::new(Some(value)),
            name,
        }
    }

    /// The argument's slot (a lock, never contended: the tries of a call run one after
    /// another; it makes the holder `Sync`, so the handler's future stays `Send`).
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<T>> {
        self.slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The argument a try gets, or why it gets none: the database aborted the first try of
    /// `scope` for a conflict, and the argument (not `Clone`) was moved into it.
    fn or_not_rerunnable(&self, argument: Option<T>, scope: &str) -> Result<T, Error> {
        argument.ok_or_else(|| Error::Conflict {
            scope: scope.to_owned(),
            message: format!(
                "the call cannot run again in this process: its argument `{}` is not `Clone` (derive `Clone` for it so a conflicting call is run again instead of answered with this error)",
                self.name
            ),
            attempts: 1,
            retry_after: crate::error::CONFLICT_RETRY_AFTER,
        })
    }
}

/// Chooses how a [`Rerun`] hands out its argument (autoref specialisation).
#[derive(Debug)]
pub struct RerunProbe<'a, T>(pub &'a Rerun<T>);

/// Chosen when the argument is `Clone`: every try gets a clone.
pub trait ViaClone<T> {
    /// The argument for the next try of a call of `scope`.
    ///
    /// # Errors
    /// Never: a clone is always there.
    fn next_try(&self, scope: &str) -> Result<T, Error>;
}
impl<T: Clone> ViaClone<T> for &RerunProbe<'_, T> {
    fn next_try(&self, scope: &str) -> Result<T, Error> {
        self.0.or_not_rerunnable(self.0.slot().clone(), scope)
    }
}

/// Chosen for every other argument: the first try gets it.
pub trait ViaMove<T> {
    /// The argument for the next try of a call of `scope`.
    ///
    /// # Errors
    /// [`Error::Conflict`] for a try after the first, which cannot have the argument.
    fn next_try(&self, scope: &str) -> Result<T, Error>;
}
impl<T> ViaMove<T> for RerunProbe<'_, T> {
    fn next_try(&self, scope: &str) -> Result<T, Error> {
        self.0.or_not_rerunnable(self.0.slot().take(), scope)
    }
}

/// What a call records: `payload` (the value, or a final error) with `status`; once it is
/// recorded the caller gets `answer`.
pub(crate) struct Record<T, E> {
    pub(crate) status: RecordStatus,
    pub(crate) payload: Vec<u8>,
    pub(crate) answer: Result<T, E>,
}

/// What a handler's output means for its record.
pub(crate) enum Verdict<T, E> {
    /// Record it.
    Record(Record<T, E>),
    /// A transient error: record nothing, free the key.
    Release(E),
    /// The value or final error could not be encoded: record nothing, free the key, and
    /// answer with this error.
    Unencodable(Error),
}

/// Sorts a handler's output: values and final errors are recorded, other errors release.
pub(crate) fn verdict<R: HandlerOutput>(
    scope: &str,
    output: R,
    finality: Option<Finality<R::Error>>,
) -> Verdict<R::Ok, R::Error>
where
    R::Ok: Replayable,
{
    let (status, payload, answer) = match output.into_result() {
        Ok(value) => (
            RecordStatus::Completed,
            serde_json::to_vec(&value),
            Ok(value),
        ),
        Err(error) if let Some(f) = finality.filter(|f| (f.is_final)(&error)) => {
            (RecordStatus::Failed, (f.encode)(&error), Err(error))
        }
        Err(error) => return Verdict::Release(error),
    };
    match payload {
        Ok(payload) => Verdict::Record(Record {
            status,
            payload,
            answer,
        }),
        Err(e) => Verdict::Unencodable(Error::Encode {
            scope: scope.to_owned(),
            source: Box::new(e),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::{Rerun, RerunProbe, ViaClone as _, ViaMove as _};
    use crate::ErrorKind;

    /// Not `Clone`: a second try cannot have it.
    struct Note;

    #[test]
    #[allow(clippy::needless_borrow)] // `&&` as the expansion writes it: autoref chooses
    fn every_try_gets_a_clone_and_only_the_first_gets_a_moved_argument() {
        let cloned = Rerun::new(String::from("ada"), "name");
        for _ in 0..3 {
            let name = (&&RerunProbe(&cloned)).next_try("greet").expect("a clone");
            assert_eq!(name, "ada");
        }
        let moved = Rerun::new(Note, "note");
        assert!((&&RerunProbe(&moved)).next_try("greet").is_ok());
        let second = (&&RerunProbe(&moved))
            .next_try("greet")
            .err()
            .expect("refused");
        assert_eq!(second.kind(), ErrorKind::Conflict);
        assert!(
            second.to_string().contains("`note` is not `Clone`"),
            "{second}"
        );
    }
}
