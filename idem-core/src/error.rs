//! The one error type of idem, its stable kinds and their HTTP statuses.

use std::time::Duration;

use crate::key_rules::KeyProblem;
use crate::precondition::InvalidEntityTag;

/// A boxed error from a lower layer (database driver, serde).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with idem's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The `Retry-After` of a conflict that reached the caller.
pub const CONFLICT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Everything that can go wrong in an idempotent call, apart from the handler's own errors.
///
/// Handlers return their own error type `E`; idem reaches them through `E: From<idem::Error>`.
/// Match on [`Error::kind`] for a stable classification.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The idempotency key (or principal) is empty, too long, not UTF-8 or has control
    /// characters. Raised before any database work.
    #[error("invalid idempotency key: {problem}")]
    InvalidKey {
        /// What is wrong with it.
        problem: KeyProblem,
    },
    /// The key expression produced no key (an `Option` that was `None`).
    #[error("missing idempotency key")]
    MissingKey,
    /// The key was used before with different arguments. The recorded result is untouched.
    #[error(
        "idempotency key reused with different arguments in scope `{scope}`; use a new key for a new request"
    )]
    KeyReused {
        /// Scope of the call.
        scope: String,
    },
    /// Another call with the same key is running and did not finish within the wait bound
    /// (or the scope rejects concurrent duplicates).
    #[error(
        "a call with the same idempotency key is in flight in scope `{scope}`; retry after {retry_after:?}"
    )]
    InFlight {
        /// Scope of the call.
        scope: String,
        /// A sensible time to wait before retrying.
        retry_after: Duration,
    },
    /// A state transition that is not allowed from the row's current state.
    #[error("invalid state transition from `{from}` to `{to}`")]
    InvalidTransition {
        /// The state the row is in.
        from: String,
        /// The state that was asked for.
        to: String,
    },
    /// A recorded step or give-up no longer deserialises into its type (the type changed
    /// after it was recorded). A recorded answer that no longer reads is
    /// [`Error::AnswerUnreadable`].
    #[error(
        "recorded result for key `{key}` in scope `{scope}` no longer decodes into the handler's type: {source}"
    )]
    Decode {
        /// Scope of the call.
        scope: String,
        /// The idempotency key.
        key: String,
        /// The serde error.
        #[source]
        source: BoxError,
    },
    /// The answer recorded for this key was written by a newer version of the answer type
    /// ([`Versioned`](crate::Versioned)) than this process knows: a newer deployment recorded
    /// it, during a rolling deploy (or after a rollback). Nothing ran; a retry that reaches a
    /// process of the newer version replays it, so retry after `retry_after` (HTTP 503).
    #[error(
        "the answer recorded for key hash {key_hash} in scope `{scope}` is version {recorded} of the handler's type; this process reads up to version {known}: a newer deployment recorded it, retry after {retry_after:?} to reach one"
    )]
    AnswerTooNew {
        /// Scope of the call.
        scope: String,
        /// The key's hash as the logs print it (the start of the record id), never the key.
        key_hash: String,
        /// The version recorded.
        recorded: u32,
        /// The version this process reads.
        known: u32,
        /// A sensible time to wait before retrying.
        retry_after: Duration,
    },
    /// The answer recorded for this key (a value or a final error) no longer decodes as the
    /// handler's type, even after the upcasts of [`Versioned`](crate::Versioned): the type
    /// changed without a new version and an upcast. The call was carried out once; running it
    /// again under a new key would repeat it. Fix: give the type a new version whose `upcast`
    /// reads the recorded shape (`idem::sea_orm::check_answers` finds such records before a
    /// deploy). HTTP 410.
    #[error(
        "the answer recorded for key hash {key_hash} in scope `{scope}` (version {recorded}) no longer decodes as version {expected} of the handler's type: {source}; the call was carried out: give the type a new `idem::Versioned::VERSION` whose `upcast` reads the recorded shape"
    )]
    AnswerUnreadable {
        /// Scope of the call.
        scope: String,
        /// The key's hash as the logs print it (the start of the record id), never the key.
        key_hash: String,
        /// The version recorded (0 when its envelope is malformed).
        recorded: u32,
        /// The version the handler's type reads.
        expected: u32,
        /// What failed (serde's message, or the upcast's).
        #[source]
        source: BoxError,
    },
    /// The handler's result could not be serialised for recording. Nothing was committed.
    #[error("result of a call in scope `{scope}` cannot be recorded: {source}")]
    Encode {
        /// Scope of the call.
        scope: String,
        /// The serde error.
        #[source]
        source: BoxError,
    },
    /// A lease-mode call lost its lease: it ran past the lease and a retry took the key over
    /// (or the record was completed meanwhile). Its step records, final writes and result
    /// were rejected and rolled back; the retry's answer stands.
    #[error(
        "the lease on a call in scope `{scope}` was taken over by a retry; this attempt's work was rejected"
    )]
    LeaseLost {
        /// Scope of the call.
        scope: String,
    },
    /// A message staged in the outbox cannot be stored: an empty or over-long topic or
    /// aggregate key, or a malformed header. Nothing was staged.
    #[error("invalid outbox message: {message}")]
    InvalidMessage {
        /// What is wrong with it.
        message: String,
    },
    /// The arguments could not be fingerprinted (their `Serialize` impl failed).
    #[error("arguments of a call in scope `{scope}` cannot be fingerprinted: {message}")]
    Fingerprint {
        /// Scope of the call.
        scope: String,
        /// What the serializer reported.
        message: String,
    },
    /// A write that must be conditional arrived without a precondition (`If-Match`).
    /// Nothing was done.
    #[error(
        "this request must be conditional: send `If-Match` with the `ETag` of your last read (or `*`)"
    )]
    PreconditionRequired,
    /// The precondition of a conditional write did not hold: the resource changed since the
    /// client read it (its version moved on). Nothing was written.
    #[error(
        "the resource changed since it was read: `If-Match` does not match its current entity tag{}; read it again and retry with the new `ETag`",
        current.as_ref().map(|tag| format!(" {tag}")).unwrap_or_default()
    )]
    PreconditionFailed {
        /// The resource's current entity tag, when it is known.
        current: Option<crate::EntityTag>,
    },
    /// A precondition header (`If-Match`) is not `*` or a list of entity tags. Raised before
    /// any database work.
    #[error("invalid precondition: {problem}")]
    InvalidPrecondition {
        /// What is wrong with it.
        problem: String,
    },
    /// A resumable call's arguments are too large to store with its claim
    /// ([`MAX_STORED_ARGS`](crate::completer::MAX_STORED_ARGS)). Raised before any database
    /// work; nothing was claimed.
    #[error(
        "the arguments of a resumable call in scope `{scope}` take {size} bytes; at most {limit} are stored with a claim: pass a reference to large data (an id) instead of the data"
    )]
    ArgumentsTooLarge {
        /// Scope of the call.
        scope: String,
        /// Size of the serialised arguments in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// A resumable call was given up: a completer tried it `attempts` times without finishing
    /// it (or its stored arguments no longer rebuild the call). The give-up is recorded, and
    /// every retry with the same key gets this answer; the application's give-up hook was
    /// told (to compensate: refund a charge, alert someone). Retrying needs a new key.
    #[error(
        "the call in scope `{scope}` was given up after {attempts} attempts ({reason}); it will not be completed: retry with a new idempotency key"
    )]
    GaveUp {
        /// Scope of the call.
        scope: String,
        /// How many times a completer tried it.
        attempts: u32,
        /// The last attempt's error.
        reason: String,
    },
    /// The database could not be reached in time: no pooled connection came within the
    /// store's bound (the server is down, unreachable, or every connection is busy). Nothing
    /// was done; retry after `retry_after`.
    #[error("the idempotency store is unavailable: {message}; retry after {retry_after:?}")]
    Unavailable {
        /// What could not be done.
        message: String,
        /// A sensible time to wait before retrying.
        retry_after: Duration,
    },
    /// The database aborted the call's transaction for a conflict with a concurrent one (a
    /// deadlock, a serialization failure, a Galera certification failure or brute-force abort)
    /// on every one of `attempts` tries. The engine runs a conflicting call again by itself
    /// ([`MAX_CONFLICT_ATTEMPTS`](crate::retry::conflict::MAX_CONFLICT_ATTEMPTS) tries, with jittered
    /// backoff), so this reaches a caller only under sustained contention. Nothing of the
    /// failed tries was committed; retry after `retry_after`.
    #[error(
        "the database aborted a call in scope `{scope}` for a conflict with a concurrent transaction on each of its {attempts} tries (last while {message}); nothing was committed: retry after {retry_after:?}"
    )]
    Conflict {
        /// Scope of the call (empty when the store reports it, before the engine knows).
        scope: String,
        /// What the database was doing, without SQL text.
        message: String,
        /// How many times the call was tried.
        attempts: u32,
        /// A sensible time to wait before retrying.
        retry_after: Duration,
    },
    /// A lease-mode call ran past its deadline (`#[idempotent(..., deadline = "5m")]`; by
    /// default [`DEFAULT_DEADLINE_LEASES`](crate::lease::DEFAULT_DEADLINE_LEASES) leases): its
    /// body was dropped and its lease ended at once, keeping the steps it recorded. A retry
    /// with the same key, or a completer for a resumable call, takes it over from them; retry
    /// after `retry_after`.
    #[error(
        "a call in scope `{scope}` ran past its deadline of {deadline:?} and was stopped; its recorded steps are kept: retry with the same key after {retry_after:?} to resume it"
    )]
    DeadlineExceeded {
        /// Scope of the call.
        scope: String,
        /// The deadline it ran past.
        deadline: Duration,
        /// A sensible time to wait before retrying.
        retry_after: Duration,
    },
    /// The store (database) failed. No partial effects were committed.
    #[error("idempotency store failed: {message}")]
    Store {
        /// A description without SQL text.
        message: String,
        /// The driver error, when there is one.
        #[source]
        source: Option<BoxError>,
    },
}

/// A stable classification of [`Error`], for matching and for protocol mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// See [`Error::InvalidKey`].
    InvalidKey,
    /// See [`Error::MissingKey`].
    MissingKey,
    /// See [`Error::KeyReused`].
    KeyReused,
    /// See [`Error::InFlight`].
    InFlight,
    /// See [`Error::InvalidTransition`].
    InvalidTransition,
    /// See [`Error::Decode`].
    Decode,
    /// See [`Error::AnswerTooNew`].
    AnswerTooNew,
    /// See [`Error::AnswerUnreadable`].
    AnswerUnreadable,
    /// See [`Error::Encode`].
    Encode,
    /// See [`Error::Fingerprint`].
    Fingerprint,
    /// See [`Error::InvalidMessage`].
    InvalidMessage,
    /// See [`Error::LeaseLost`].
    LeaseLost,
    /// See [`Error::PreconditionRequired`].
    PreconditionRequired,
    /// See [`Error::PreconditionFailed`].
    PreconditionFailed,
    /// See [`Error::InvalidPrecondition`].
    InvalidPrecondition,
    /// See [`Error::ArgumentsTooLarge`].
    ArgumentsTooLarge,
    /// See [`Error::GaveUp`].
    GaveUp,
    /// See [`Error::Unavailable`].
    Unavailable,
    /// See [`Error::Conflict`].
    Conflict,
    /// See [`Error::DeadlineExceeded`].
    DeadlineExceeded,
    /// See [`Error::Store`].
    Store,
}

impl ErrorKind {
    /// A stable kebab-case name, usable as a problem type or metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InvalidKey => "invalid-key",
            Self::MissingKey => "missing-key",
            Self::KeyReused => "key-reused",
            Self::InFlight => "in-flight",
            Self::InvalidTransition => "invalid-transition",
            Self::Decode => "decode",
            Self::AnswerTooNew => "answer-too-new",
            Self::AnswerUnreadable => "answer-unreadable",
            Self::Encode => "encode",
            Self::Fingerprint => "fingerprint",
            Self::InvalidMessage => "invalid-message",
            Self::LeaseLost => "lease-lost",
            Self::PreconditionRequired => "precondition-required",
            Self::PreconditionFailed => "precondition-failed",
            Self::InvalidPrecondition => "invalid-precondition",
            Self::ArgumentsTooLarge => "arguments-too-large",
            Self::GaveUp => "gave-up",
            Self::Unavailable => "unavailable",
            Self::Conflict => "conflict",
            Self::DeadlineExceeded => "deadline-exceeded",
            Self::Store => "store",
        }
    }

    /// The HTTP status the IETF Idempotency-Key draft, RFC 9110 and RFC 6585 (428) give this
    /// kind.
    pub const fn http_status(self) -> u16 {
        match self {
            Self::InvalidKey | Self::MissingKey | Self::InvalidPrecondition => 400,
            Self::PreconditionFailed => 412,
            Self::PreconditionRequired => 428,
            Self::KeyReused => 422,
            Self::ArgumentsTooLarge => 413,
            // Gone: this process cannot give the recorded answer back, and no retry will
            // (until a deploy reads it); the call happened, so a client must not re-send it
            // under a new key.
            Self::AnswerUnreadable => 410,
            Self::InFlight | Self::InvalidTransition | Self::LeaseLost => 409,
            // A newer deployment can answer (answer too new), or the call was stopped and a
            // retry takes it over (deadline): retry until it does.
            Self::Store
            | Self::Unavailable
            | Self::Conflict
            | Self::AnswerTooNew
            | Self::DeadlineExceeded => 503,
            Self::Decode
            | Self::Encode
            | Self::Fingerprint
            | Self::InvalidMessage
            | Self::GaveUp => 500,
        }
    }
}

impl Error {
    /// The stable kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidKey { .. } => ErrorKind::InvalidKey,
            Self::MissingKey => ErrorKind::MissingKey,
            Self::KeyReused { .. } => ErrorKind::KeyReused,
            Self::InFlight { .. } => ErrorKind::InFlight,
            Self::InvalidTransition { .. } => ErrorKind::InvalidTransition,
            Self::Decode { .. } => ErrorKind::Decode,
            Self::AnswerTooNew { .. } => ErrorKind::AnswerTooNew,
            Self::AnswerUnreadable { .. } => ErrorKind::AnswerUnreadable,
            Self::Encode { .. } => ErrorKind::Encode,
            Self::Fingerprint { .. } => ErrorKind::Fingerprint,
            Self::InvalidMessage { .. } => ErrorKind::InvalidMessage,
            Self::LeaseLost { .. } => ErrorKind::LeaseLost,
            Self::PreconditionRequired => ErrorKind::PreconditionRequired,
            Self::PreconditionFailed { .. } => ErrorKind::PreconditionFailed,
            Self::InvalidPrecondition { .. } => ErrorKind::InvalidPrecondition,
            Self::ArgumentsTooLarge { .. } => ErrorKind::ArgumentsTooLarge,
            Self::GaveUp { .. } => ErrorKind::GaveUp,
            Self::Unavailable { .. } => ErrorKind::Unavailable,
            Self::Conflict { .. } => ErrorKind::Conflict,
            Self::DeadlineExceeded { .. } => ErrorKind::DeadlineExceeded,
            Self::Store { .. } => ErrorKind::Store,
        }
    }

    /// Shorthand for `self.kind().http_status()`.
    pub fn http_status(&self) -> u16 {
        self.kind().http_status()
    }

    /// A transient conflict a store met while `doing` something: one try of a call, which the
    /// engine runs again ([`Error::Conflict`]; it fills in the scope and the count).
    pub fn conflict(doing: impl Into<String>) -> Self {
        Self::Conflict {
            scope: String::new(),
            message: doing.into(),
            attempts: 1,
            retry_after: CONFLICT_RETRY_AFTER,
        }
    }

    /// Whether the engine runs the call again for this error ([`Error::Conflict`]).
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict { .. })
    }

    /// A store error with a message and the driver error behind it.
    pub fn store(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Store {
            message: message.into(),
            source: Some(source.into()),
        }
    }
}

impl From<InvalidEntityTag> for Error {
    fn from(e: InvalidEntityTag) -> Self {
        Self::InvalidPrecondition {
            problem: e.to_string(),
        }
    }
}
