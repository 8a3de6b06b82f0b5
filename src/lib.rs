#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// Makes an `async fn` safe to retry.
///
/// ```text
/// #[idempotent(
///     scope = "orders.pay",            // required: names the operation; stable across refactors
///     key = cmd.idempotency_key,       // required: expression over the arguments (a `KeySource`)
///     principal = cmd.customer_id,     // optional: tenant/user/client; keys never cross principals
///     skip(clock, now),                // optional: parameters left out of the fingerprint
///     ttl = "24h",                     // optional: how long results are kept (database clock),
///                                      //   or a `Duration` expression: `ttl = settings.record_ttl`
///     on_concurrent = wait,            // optional: `wait` (default, bounded at 5 s), `wait("2s")`
///                                      //   (another bound) or `reject` (`InFlight` at once)
///     mode = observe,                  // optional: `enforce` (default) or `observe` (shadow mode:
///                                      //   the body runs every time; idem reports what it would do)
///     conn = self.db as db,            // optional: where the connection comes from
///     crate = "::my_app::idem",        // optional: path to this crate for re-exporters
/// )]
/// ```
///
/// # The connection and the transaction
///
/// The first parameter is the connection (`db: &DatabaseConnection`), unless `conn` names
/// another parameter (`conn = db`) or an expression with the name the body uses
/// (`conn = self.db as db`). **Inside the body that name is the claim's transaction**
/// (`&DatabaseTransaction`): the body's reads and writes, the claim and the recorded result
/// commit together. Do not reach the pool any other way inside the body (SQLite's default
/// pool has one connection, and the body would wait for itself): an idempotent call through
/// the pool inside a body fails at once. To call another `#[idempotent]` function from the
/// body, pass it `db`: a function whose connection is `&DatabaseTransaction` (or
/// `&DatabaseExecutor<'_>`) claims its key in a savepoint and commits with this call.
///
/// # What a call does
///
/// 1. validates the key (and principal): `Error::InvalidKey` / `Error::MissingKey` before any
///    database work;
/// 2. fingerprints the scope and every argument except the connection, `self` and `skip(..)`
///    (canonical SHA-256; arguments must implement `serde::Serialize`);
/// 3. claims `(scope, principal, key)` in a new transaction. A live record with another
///    fingerprint is `Error::KeyReused`; a live record with the same fingerprint is replayed
///    without running the body; a concurrent duplicate waits for the first call (or fails
///    with `Error::InFlight` under `on_concurrent = reject`);
/// 4. runs the body in that transaction;
/// 5. `Ok(v)`: records `v` (serde JSON) and commits. `Err(e)`: rolls back, so a retry runs
///    again, unless `E` implements [`FinalError`] and `e.is_final()`: then the body's writes
///    roll back and the error is recorded and replayed.
///
/// Dropping the future (timeout, client gone) rolls the transaction back: nothing is left
/// claimed. Use [`with_outcome`] to tell an execution from a replay.
///
/// With `mode = observe` ([`Mode::Observe`]) steps 1 to 3 decide as above and are reported (a
/// log line and the `idem_observed_total` counter), but every call runs its body and answers
/// its own answer; the ledger is written as when enforcing, so switching to `enforce` needs no
/// migration. See the guide's "Observe mode before enforcing".
///
/// # Requirements, checked at compile time
///
/// - an `async fn` returning `Result<T, E>` with `T: Serialize + DeserializeOwned` and
///   `E: From<idem::Error>`;
/// - fingerprinted arguments implement `Serialize`; the key expression is a [`KeySource`].
///
/// ```
/// use idem::idempotent;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize)]
/// struct Greet { request_id: String, name: String }
///
/// #[idempotent(scope = "greet", key = cmd.request_id)]
/// async fn greet(store: &idem::MemoryStore, cmd: Greet) -> Result<String, idem::Error> {
///     Ok(format!("hello, {}", cmd.name))
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = idem::MemoryStore::new();
/// let first = greet(&store, Greet { request_id: "r-1".into(), name: "ada".into() }).await;
/// let again = greet(&store, Greet { request_id: "r-1".into(), name: "ada".into() }).await;
/// assert_eq!(first.unwrap(), again.unwrap());
/// let other = greet(&store, Greet { request_id: "r-1".into(), name: "bob".into() }).await;
/// assert_eq!(other.unwrap_err().kind(), idem::ErrorKind::KeyReused);
/// # });
/// ```
pub use idem_macros::idempotent;

/// Derives [`StateMachine`] for a state enum from `#[transitions(A -> B, ...)]`.
pub use idem_macros::StateMachine;

/// A transition checked at compile time: `transition!(OrderStatus: Pending -> Paid)` is an
/// [`idem::Transition`](Transition) if `OrderStatus` declares `Pending -> Paid`, else a
/// compile error on `Pending -> Paid`.
pub use idem_macros::transition;

pub use idem_core::{
    BoxError, EntityTag, Error, ErrorKind, FinalError, Fingerprint, Fingerprinter, Fingerprints,
    IfMatch, InvalidEntityTag, Key, KeyProblem, KeySource, MAX_KEY_LEN, MemoryStore, MemoryTx,
    Mode, Outcome, Result, StateMachine, Store, Transition, TransitionOutcome, Versioned,
    with_outcome,
};

/// Answers whose type evolves ([`Versioned`]): the envelope a recorded answer carries its
/// version in, and how a reader upcasts older versions. See the guide, "Evolving answers"
/// (`docs/guide/attribute.md`).
pub mod versioned {
    pub use idem_core::versioned::{
        AnswerError, AnswerVersion, NEWER_RETRY_AFTER, Versioned, recorded_version,
    };
}

/// Transient database conflicts, retried inside the call: how many tries, and what one costs.
pub mod conflict {
    pub use idem_core::retry::conflict::{MAX_CONFLICT_ATTEMPTS, RETRY_AFTER, set_max_attempts};
    pub use idem_core::{CallReport, with_report};
}

/// Building blocks for custom stores and wrappers: the store contracts, the call's request,
/// and the conversions `#[idempotent]` uses to reach a store from its connection.
pub mod store {
    pub use idem_core::ledger::ids::random_token;
    pub use idem_core::record_id;
    pub use idem_core::{
        BoxFuture, Claim, Concurrency, LeaseClaim, LeaseStore, RecordStatus, Recorded, Request,
        Store, Ticket,
    };

    /// What the connection of an atomic-mode `#[idempotent]` function is: something that
    /// lends a [`Store`]. Implemented for `sea_orm::DatabaseConnection` (feature `sea-orm`),
    /// sqlx's pools (feature `sqlx`) and [`MemoryStore`](crate::MemoryStore); implement it for your own store's handle and
    /// the attribute works with it the same way.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not a connection `#[idempotent]` can claim keys on",
        label = "expected the connection here",
        note = "the first parameter of an `#[idempotent]` fn is its connection (`db: &sea_orm::DatabaseConnection`, or a sqlx pool such as `db: &sqlx::PgPool` with feature `sqlx-postgres`); put it first, or name it with `conn = <param>` or `conn = self.db as db`"
    )]
    pub trait IntoStore {
        /// The store over this connection.
        type Store<'a>: Store
        where
            Self: 'a;
        /// Lends the store.
        fn store(&self) -> Self::Store<'_>;
    }

    impl<C: IntoStore + ?Sized> IntoStore for &C {
        type Store<'a>
            = C::Store<'a>
        where
            Self: 'a;
        fn store(&self) -> Self::Store<'_> {
            (**self).store()
        }
    }

    impl IntoStore for idem_core::MemoryStore {
        // A clone shares the ledger.
        type Store<'a> = idem_core::MemoryStore;
        fn store(&self) -> Self::Store<'_> {
            self.clone()
        }
    }

    #[cfg(feature = "sea-orm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sea-orm")))]
    impl IntoStore for idem_sea_orm::sea_orm::DatabaseConnection {
        // Lifetime-free: a store that borrowed the connection would be invariant in its
        // lifetime (it may also hold a body), which rustc cannot prove `Send` for inside
        // spawned and boxed futures.
        type Store<'a> = idem_sea_orm::SeaOrmStore;
        fn store(&self) -> Self::Store<'_> {
            idem_sea_orm::SeaOrmStore::new(self)
        }
    }

    /// A nested call: an `#[idempotent]` function called with another one's body `db`
    /// claims its key in a savepoint of that transaction, and commits with it or not at all.
    #[cfg(feature = "sea-orm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sea-orm")))]
    impl IntoStore for idem_sea_orm::sea_orm::DatabaseTransaction {
        type Store<'a> = idem_sea_orm::NestedStore<'a>;
        fn store(&self) -> Self::Store<'_> {
            idem_sea_orm::NestedStore::new(self)
        }
    }

    /// A sqlx pool (feature `sqlx-postgres`, `sqlx-mysql` or `sqlx-sqlite`): the body's
    /// connection is the claim's transaction as sqlx's executors take it (`&mut
    /// PgConnection`), so `query.execute(&mut *db)` commits with the recorded answer.
    #[cfg(feature = "sqlx")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
    impl<DB: idem_sqlx::Backend> IntoStore for idem_sqlx::sqlx::Pool<DB> {
        type Store<'a> = idem_sqlx::SqlxStore<DB>;
        fn store(&self) -> Self::Store<'_> {
            idem_sqlx::SqlxStore::new(self)
        }
    }

    /// A sqlx connection chosen by the caller (feature `sqlx-postgres`, `sqlx-mysql` or
    /// `sqlx-sqlite`): a pool at the top (`(&pool).into()`), or another call's body `db`
    /// (`(&mut *db).into()`), where the call claims its key in a savepoint of that
    /// transaction and commits with it or not at all.
    #[cfg(feature = "sqlx")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
    impl<'c, DB: idem_sqlx::Backend> IntoStore for idem_sqlx::Conn<'c, DB> {
        type Store<'a>
            = idem_sqlx::ConnStore<'a, 'c, DB>
        where
            Self: 'a;
        fn store(&self) -> Self::Store<'_> {
            idem_sqlx::Conn::store(self)
        }
    }

    /// Either, chosen by the caller: a function whose connection is a
    /// `&DatabaseExecutor<'_>` can be called at the top (`&db.into()` from a
    /// `&DatabaseConnection`) and nested (from a body's `&DatabaseTransaction`).
    #[cfg(feature = "sea-orm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sea-orm")))]
    impl IntoStore for idem_sea_orm::sea_orm::DatabaseExecutor<'_> {
        type Store<'a>
            = idem_sea_orm::ExecutorStore<'a>
        where
            Self: 'a;
        fn store(&self) -> Self::Store<'_> {
            use idem_sea_orm::sea_orm::DatabaseExecutor as E;
            match self {
                E::Connection(db) => idem_sea_orm::ExecutorStore::new(*db),
                E::Transaction(tx) => idem_sea_orm::ExecutorStore::nested(tx),
                E::OwnedTransaction(tx) => idem_sea_orm::ExecutorStore::nested(tx),
            }
        }
    }

    /// A deadpool-postgres pool (feature `tokio-postgres`): the body's connection is the
    /// claim's transaction as a `&ClientWrapper`, so `db.execute(..)` commits with the
    /// recorded answer.
    #[cfg(feature = "tokio-postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio-postgres")))]
    impl IntoStore for idem_tokio_postgres::deadpool_postgres::Pool {
        type Store<'a> = idem_tokio_postgres::TokioPostgresStore;
        fn store(&self) -> Self::Store<'_> {
            idem_tokio_postgres::TokioPostgresStore::new(self)
        }
    }

    /// A nested call on tokio-postgres: an `#[idempotent]` function called with another
    /// one's body `db` (a `&ClientWrapper`) claims its key in a savepoint of that
    /// transaction, and commits with it or not at all.
    #[cfg(feature = "tokio-postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio-postgres")))]
    impl IntoStore for idem_tokio_postgres::deadpool_postgres::ClientWrapper {
        type Store<'a> = idem_tokio_postgres::NestedStore<'a>;
        fn store(&self) -> Self::Store<'_> {
            idem_tokio_postgres::NestedStore::new(self)
        }
    }

    /// What the connection of a lease-mode `#[idempotent(..., lease = "…")]` function is:
    /// something that hands out an owned, shareable [`LeaseStore`] (the lease outlives the
    /// claim). Implemented for `sea_orm::DatabaseConnection`, sqlx's pools (feature `sqlx`)
    /// and [`MemoryStore`](crate::MemoryStore); implement it for your own store's handle.
    #[diagnostic::on_unimplemented(
        message = "`{Self}` cannot hold the leases of `#[idempotent(..., lease = ...)]`",
        label = "expected the connection here",
        note = "lease mode needs a `sea_orm::DatabaseConnection`, a sqlx pool (`&sqlx::PgPool`, …) or an `idem::MemoryStore`: its lease commits at once and outlives any transaction, so it cannot claim inside another call's transaction (`&DatabaseTransaction`); call it with the pool, before or after that call"
    )]
    pub trait IntoLeaseStore {
        /// An owned lease store over this connection.
        fn lease_store(&self) -> std::sync::Arc<dyn LeaseStore>;
    }

    impl<C: IntoLeaseStore + ?Sized> IntoLeaseStore for &C {
        fn lease_store(&self) -> std::sync::Arc<dyn LeaseStore> {
            (**self).lease_store()
        }
    }

    impl IntoLeaseStore for idem_core::MemoryStore {
        fn lease_store(&self) -> std::sync::Arc<dyn LeaseStore> {
            std::sync::Arc::new(self.clone())
        }
    }

    #[cfg(feature = "sea-orm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sea-orm")))]
    impl IntoLeaseStore for idem_sea_orm::sea_orm::DatabaseConnection {
        fn lease_store(&self) -> std::sync::Arc<dyn LeaseStore> {
            std::sync::Arc::new(idem_sea_orm::SeaOrmLeaseStore::new(self.clone()))
        }
    }

    /// A sqlx pool (feature `sqlx-postgres`, `sqlx-mysql` or `sqlx-sqlite`): the lease store
    /// on a clone of it (which shares the pool).
    #[cfg(feature = "sqlx")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
    impl<DB: idem_sqlx::Backend> IntoLeaseStore for idem_sqlx::sqlx::Pool<DB> {
        fn lease_store(&self) -> std::sync::Arc<dyn LeaseStore> {
            std::sync::Arc::new(idem_sqlx::SqlxLeaseStore::new(self.clone()))
        }
    }

    /// A deadpool-postgres pool (feature `tokio-postgres`): the lease store on a clone of it.
    #[cfg(feature = "tokio-postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio-postgres")))]
    impl IntoLeaseStore for idem_tokio_postgres::deadpool_postgres::Pool {
        fn lease_store(&self) -> std::sync::Arc<dyn LeaseStore> {
            std::sync::Arc::new(idem_tokio_postgres::TokioPostgresStore::new(self))
        }
    }
}

/// Effects outside the database: messages staged in a handler's transaction and relayed
/// afterwards (the outbox), sinks, and the consumer-side dead letters. Staging and the relay
/// run on both stores: [`sea_orm::Outbox`] and [`sea_orm::Relay`], [`sqlx::Outbox`] and
/// [`sqlx::Relay`]. See `docs/OUTBOX.md`.
pub mod outbox {
    pub use idem_core::outbox::{
        Backoff, DeadLetter, DeadLetters, FnSink, LogSink, MAX_NAME_LEN, Message, OutboxHealth,
        OutboxMessage, RelayOptions, Sink, SinkError, wake,
    };
}

/// The consuming side, whatever the broker: a [`Runner`](inbox::Runner) hands each message
/// of a [`Source`](inbox::Source) to a handler and acknowledges it only after the handler
/// succeeded; an `#[idempotent]` handler keyed by [`Delivery::id`](inbox::Delivery::id) makes
/// the ledger its inbox. Failing messages are retried with backoff, then recorded in the
/// [dead letters](outbox::DeadLetters). JetStream's source is in `idem::nats` (feature
/// `nats`), RabbitMQ's in `idem::rabbitmq` (feature `rabbitmq`); a broker of your own is an adapter of a few dozen lines (see [`inbox::Source`]).
pub mod inbox {
    pub use idem_core::inbox::{Delivery, MemorySource, Runner, Source};
}

/// NATS JetStream (the `idem-nats` crate): a sink for the outbox relay, and a source for
/// the [inbox runner](inbox::Runner) whose `#[idempotent]` handler makes the ledger its inbox
/// ([`Consumer`](nats::Consumer) builds the two in one expression).
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats {
    pub use idem_nats::{
        AGGREGATE_HEADER, AGGREGATE_SEQ_HEADER, Consumer, Delivery, JetStreamSink, JetStreamSource,
        MESSAGE_ID_HEADER, async_nats, ensure_stream,
    };
}

/// RabbitMQ on lapin (the `idem-rabbitmq` crate): a sink for the outbox relay that counts a
/// publish once the broker confirmed it, and a source for the [inbox runner](inbox::Runner)
/// with manual acknowledgements ([`Consumer`](rabbitmq::Consumer) builds the two in one
/// expression; [`declare`](rabbitmq::declare) the exchange and quorum queue).
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq {
    pub use idem_rabbitmq::{
        AGGREGATE_HEADER, AGGREGATE_SEQ_HEADER, AmqpSink, AmqpSource, Consumer, Delivery, declare,
        lapin,
    };
}

/// Metric names and labels (feature `metrics`): a counter of outcomes per scope and a latency
/// histogram, through the `metrics` facade.
pub use idem_core::metrics;

/// Runs a recovery point of a lease-mode handler once, recording its value; see
/// [`lease::step`].
pub use idem_core::lease::step;

/// Lease mode (`#[idempotent(..., lease = "30s")]`): recovery points ([`step`]), derived
/// downstream keys, and the store contract. The SeaORM final phase is
/// [`sea_orm::final_step`] (or [`sea_orm::finish`] as the last work).
pub mod lease {
    pub use idem_core::derived_key;
    pub use idem_core::lease::{LeaseHandle, step};
    pub use idem_core::{BoxFuture, LeaseClaim, LeaseStore, Ticket};
}

/// Finishing lease-mode calls their clients abandoned: a resumable handler
/// (`#[idempotent(..., lease = "30s", resumable)]`) stores its arguments with its claim, and a
/// completer ([`sea_orm::Completer`] on SeaORM, `sqlx::Completer<DB>` on a sqlx pool) takes over calls whose lease ended, runs the
/// resumer registered for their scope, and gives a call up after its last attempt; see
/// [`idem_core::completer`].
pub mod completer {
    pub use idem_core::completer::{
        Completer, DEFAULT_MAX_ATTEMPTS, Due, GaveUp, HOOK_RETRY, MAX_STORED_ARGS, ResumeStore,
        Resumed, Round, Steps, StoredCall,
    };
}

/// HTTP glue for axum 0.8 (the IETF Idempotency-Key draft; the `idem-axum` crate): the
/// `Idempotency-Key` extractor, problem+json errors with the draft's statuses
/// ([`Problem`](axum::Problem): `Problem::from(e).into_response()` answers an [`Error`]),
/// [`respond`](axum::respond), which runs the call to completion on a task of its own (a
/// client that hangs up cannot cut it off) and adds `Idempotent-Replayed: true` to replays
/// ([`Respond`](axum::Respond) to answer replays with 200 or send an `ETag`), the
/// [`IfMatch`](axum::IfMatch) extractor for conditional writes (428 without it, 412 when it no
/// longer matches; see [`sea_orm::Stateful::update_if_match`]), [`ETag`](axum::ETag) for a
/// response's tag, [`IdempotencyLayer`](axum::IdempotencyLayer), which records whole
/// responses of plain routes, and for server-rendered forms [`Keyed`](axum::Keyed) (the key in
/// a form field, a query parameter or a JSON member) and [`respond_answer`](axum::respond_answer)
/// (an [`Answer`](axum::Answer) such as a `303 See Other` replayed with its headers).
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod axum {
    pub use idem_axum::{
        Answer, ETag, EntityTag, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_FIELD, IDEMPOTENT_REPLAYED,
        IdempotencyKey, IdempotencyLayer, IdempotencyService, IfMatch, Keyed, Problem,
        ReplayStatus, Respond, respond, respond_answer, respond_inline, run_to_completion,
    };
}

/// actix-web 4 glue (feature `actix`; the `idem-actix` crate), the same contract as
/// `idem::axum`, over [`idem::http`](crate::http): the [`IdempotencyKey`](actix::IdempotencyKey) extractor (400
/// without a valid key), [`Problem`](actix::Problem) as actix's `ResponseError` (every
/// [`Error`] with its status, problem+json and `Retry-After`), and
/// [`respond`](actix::respond), which runs the call to completion on a task of its own and
/// marks replays with `Idempotent-Replayed: true`; for server-rendered forms
/// [`Keyed`](actix::Keyed) and [`respond_answer`](actix::respond_answer), as on axum.
#[cfg(feature = "actix")]
#[cfg_attr(docsrs, doc(cfg(feature = "actix")))]
pub mod actix {
    pub use idem_actix::{
        Answer, ETag, EntityTag, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_FIELD, IDEMPOTENT_REPLAYED,
        IdempotencyKey, IdempotencyMiddleware, IdempotencyMiddlewareService, IfMatch, Keyed,
        Problem, ReplayStatus, Respond, respond, respond_answer,
    };
}

/// tonic (gRPC) glue (feature `tonic`; the `idem-tonic` crate): the contract of `idem::http`
/// mapped onto gRPC. [`idempotency_key`](tonic::idempotency_key) reads the `idempotency-key`
/// metadata (as idem's one [`IdempotencyKey`](tonic::IdempotencyKey)),
/// [`status`](tonic::status) answers every idem error with its gRPC code (the table in
/// [`idem_tonic`]), [`respond`](tonic::respond) runs a call to completion and marks replays
/// `idempotent-replayed: true`, and [`IdempotencyLayer`](tonic::IdempotencyLayer) records
/// whole unary calls, fingerprinting their decoded messages.
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub mod tonic {
    pub use idem_tonic::{
        GRPC_RETRY_PUSHBACK_MS, IDEM_PROBLEM, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKey,
        IdempotencyLayer, IdempotencyService, IntoStatus, RETRY_AFTER, code, idempotency_key,
        key_of_metadata, optional_idempotency_key, respond, status,
    };
}

/// The SeaORM ledger store: schema, migration, purge.
#[cfg(feature = "sea-orm")]
#[cfg_attr(docsrs, doc(cfg(feature = "sea-orm")))]
pub mod sea_orm {
    #[cfg(feature = "migration")]
    #[cfg_attr(docsrs, doc(cfg(feature = "migration")))]
    pub use idem_sea_orm::Migration;
    pub use idem_sea_orm::inspect;
    pub use idem_sea_orm::{AnswerCheck, check, check_answers, check_final_errors};
    pub use idem_sea_orm::{
        CALLS_TABLE, ClaimedTx, Completer, ConditionalUpdate, DEAD_LETTERS_TABLE, DeadLetterTable,
        DeadMessage, ExecutorStore, ExpiredLease, ExpiredPurge, LEDGER_TABLE, NestedStore,
        OUTBOX_HEADS_TABLE, OUTBOX_TABLE, Outbox, Relay, RelayCounters, RelayRound, STEPS_TABLE,
        SeaOrm, SeaOrmLeaseStore, SeaOrmStore, Stateful, create_tables, database_now_ms,
        dead_messages, expired_leases, final_step, finish, ledger, outbox_health, placeholders,
        purge_expired, purge_published, retry_dead, set_connection_wait,
    };
    #[cfg(feature = "migration")]
    #[cfg_attr(docsrs, doc(cfg(feature = "migration")))]
    pub use idem_sea_orm::{CompleterMigration, LeaseMigration, OutboxMigration, migrations};
    pub use idem_sea_orm::{Family, schema};
    pub use idem_sea_orm::{StuckLease, release_lease, stuck_leases};
}

/// The sqlx ledger store (feature `sqlx-postgres`, `sqlx-mysql` or `sqlx-sqlite`; the
/// `idem-sqlx` crate, sqlx 0.9): an `#[idempotent]` function whose connection is a sqlx pool
/// runs its body in the claim's transaction, lent as `&mut PgConnection` (`&mut
/// MySqlConnection`, `&mut SqliteConnection`). [`create_tables`](sqlx::create_tables) makes
/// the tables at start-up, or `idem schema` prints them for your migrations. Lease mode
/// (`lease = "30s"`) runs on the same pools ([`SqlxLeaseStore`](sqlx::SqlxLeaseStore)): its
/// body's database writes go in [`final_step`](sqlx::final_step) or [`finish`](sqlx::finish).
/// A function whose connection is a [`Conn`](sqlx::Conn) also runs nested, in another call's
/// body on its `&mut PgConnection` (`(&mut *db).into()`), in a savepoint of that transaction.
/// [`StateTable`](sqlx::StateTable) applies declared state transitions to a table of yours
/// with one guarded `UPDATE` in the body's transaction. The outbox: a body stages messages
/// on its connection ([`Outbox::stage`](sqlx::Outbox::stage)), a [`Relay`](sqlx::Relay) on
/// a pool publishes them. A [`Completer`](sqlx::Completer) finishes resumable lease-mode
/// calls whose clients did not come back.
#[cfg(feature = "sqlx")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
pub mod sqlx {
    pub use idem_sqlx::{AnswerCheck, check, check_answers, check_final_errors};
    pub use idem_sqlx::{
        Backend, Bindable, ClaimedTx, Completer, Conn, ConnClaimed, ConnStore, DeadLetterTable,
        DeadMessage, ExpiredLease, ExpiredPurge, Family, Nested, NestedClaim, Outbox, Relay,
        RelayCounters, RelayRound, Sqlx, SqlxLeaseStore, SqlxStore, StateConnection, StateTable,
        StuckLease, create_tables, dead_messages, expired_leases, final_step, finish,
        outbox_health, purge_expired, purge_published, release_lease, retry_dead, stuck_leases,
        through_transaction_pooler,
    };
    pub use idem_sqlx::{database_now_ms, inspect};
}

/// The tokio-postgres store (feature `tokio-postgres`, the `idem-tokio-postgres` crate):
/// `#[idempotent]` on a function whose connection is a `&deadpool_postgres::Pool`; inside
/// the body `db` is the claim's transaction as a `&deadpool_postgres::ClientWrapper` (it
/// derefs to `tokio_postgres::Client`), so `db.execute(..)` commits with the recorded
/// answer. A function whose connection is a `&ClientWrapper`, called with a body's `db`,
/// claims in a savepoint of that transaction. Lease mode ([`final_step`](tokio_postgres::final_step),
/// [`finish`](tokio_postgres::finish)), the [`Completer`](tokio_postgres::Completer), the
/// outbox ([`Outbox::stage`](tokio_postgres::Outbox::stage), [`Relay`](tokio_postgres::Relay))
/// and the operator's functions ([`purge_expired`](tokio_postgres::purge_expired),
/// [`inspect`](tokio_postgres::inspect), ...) run on the same pool.
#[cfg(feature = "tokio-postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio-postgres")))]
pub mod tokio_postgres {
    pub use idem_tokio_postgres::{
        AnswerCheck, ClaimedTx, Completer, DeadLetterTable, DeadMessage, ExpiredLease,
        ExpiredPurge, Family, NestedStore, Outbox, Relay, RelayCounters, RelayRound, StuckLease,
        TokioPostgres, TokioPostgresStore, check, check_answers, check_final_errors, create_tables,
        database_now_ms, dead_messages, deadpool_postgres, expired_leases, final_step, finish,
        inspect, outbox_health, purge_expired, purge_published, release_lease, retry_dead,
        stuck_leases,
    };
}

/// The HTTP contract (IETF Idempotency-Key draft, RFC 9457 problems, RFC 9110 `If-Match`) on
/// the `http` crate's types, for a service on any web framework (feature `http`; `axum` turns
/// it on): `Problem::from(&e).to_response()` answers an [`Error`] with its status, problem
/// document and `Retry-After`; `idempotency_key(headers)` reads the key; `json_answer` (or `JsonAnswer`, its options) and
/// `mark_replayed` answer values and replays; `Answer` is an answer recorded with its status
/// and headers (a `303 See Other`, a page); `key_of_request` finds a key in the header, a
/// query parameter or a form or JSON body; `run_to_completion` keeps a call running when
/// its client hangs up. `idem::axum` is the axum adapter over it.
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http {
    pub use idem_http::{
        Answer, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_FIELD, IDEMPOTENT_REPLAYED, IdempotencyKey,
        JsonAnswer, Keyed, Problem, ReplayStatus, canonical, etag_value, idempotency_key, if_match,
        json_answer, key_of_request, mark_replayed, parse_entity_tag, parse_if_match, parse_key,
        run_to_completion, spawn_and_wait,
    };
}

/// Tests of a service that uses idem. Switching idem off: [`run_disabled`](testing::run_disabled)
/// for one future, [`disable`](testing::disable) for the process, or `IDEM_DISABLED=1`.
/// Crash-testing a handler: [`CrashTest`](testing::CrashTest) runs its call once per crash
/// point idem has on its path ([`CrashPoint`](testing::CrashPoint)), kills it there, lets the
/// retry (or a completer) finish it, and reports whether its effects happened once and the
/// answer was the recorded one. See the guide's "Testing a service that uses idem"
/// (`docs/guide/testing.md`).
///
/// ```
/// use idem::{idempotent, testing::CrashTest};
/// use std::sync::atomic::{AtomicU64, Ordering};
///
/// #[idempotent(scope = "mail.send", key = key, lease = "30s", skip(outbox))]
/// async fn send(store: &idem::MemoryStore, outbox: &AtomicU64, key: String) -> Result<u64, idem::Error> {
///     // The effect is a step: recorded once it ran, replayed by the next holder.
///     idem::step("send", |_step_key| async { Ok(outbox.fetch_add(1, Ordering::SeqCst) + 1) }).await
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = idem::MemoryStore::new();
/// let report = CrashTest::new(
///     async |scenario: &idem::testing::Scenario| (scenario.key.clone(), AtomicU64::new(0)),
///     async |(key, outbox): &(String, AtomicU64)| send(&store, outbox, key.clone()).await,
///     async |(_, outbox): &(String, AtomicU64)| outbox.load(Ordering::SeqCst), // the effects
/// )
/// .run()
/// .await;
/// println!("{report}");
/// // The lease's claim, the step's three points and the record; one of them fails: a
/// // crash after the send, before it was recorded, sends again (the outbox ignores the
/// // step's key, which a real receiver must deduplicate on).
/// assert_eq!(report.points().len(), 5);
/// assert_eq!(report.failures().count(), 1);
/// # });
/// ```
pub mod testing {
    pub use idem_core::testing::{
        CrashPoint, CrashReport, CrashRun, CrashTest, DEFAULT_CALL_TIMEOUT, DISABLED_ENV, Finisher,
        NoCompleter, Reached, Scenario, WithCompleter, disable, enable, is_disabled, run_disabled,
    };
}

/// What `#[idempotent]` expands to: idem-core's `__private`, and the three functions that
/// reach a store through the facade's connection traits. Not public API: it changes without
/// notice.
#[doc(hidden)]
pub mod __private {
    pub use idem_core::__private::*;

    use crate::store::{IntoLeaseStore, IntoStore};

    /// The store behind a connection expression.
    pub fn store<C: IntoStore + ?Sized>(connection: &C) -> C::Store<'_> {
        connection.store()
    }

    /// Hands `body` back, with its signature given: it takes what the store behind
    /// `connection` lends of its claim (atomic mode builds the body inside a factory, where
    /// no other expected signature reaches it).
    pub fn body_for<'c, C, R, B>(_connection: &'c C, body: B) -> B
    where
        C: IntoStore + ?Sized,
        B: for<'t> AsyncFnOnce(<C::Store<'c> as idem_core::Store>::Tx<'t>) -> R,
    {
        body
    }

    /// The lease store behind a connection expression; with idem switched off
    /// ([`crate::testing`]), a fresh in-memory one, so the body runs and nothing is kept.
    pub fn lease_store<C: IntoLeaseStore + ?Sized>(
        connection: &C,
    ) -> std::sync::Arc<dyn idem_core::LeaseStore> {
        if idem_core::testing::is_disabled() {
            return std::sync::Arc::new(idem_core::MemoryStore::new());
        }
        connection.lease_store()
    }
}

/// The guide's chapters (`docs/guide/`), whose Rust snippets are compiled as doctests, as the
/// README's are (it is this crate's documentation).
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../docs/guide/attribute.md")]
    mod attribute {}
    #[doc = include_str!("../docs/guide/sqlx.md")]
    mod sqlx {}
    #[doc = include_str!("../docs/guide/http.md")]
    mod http {}
    #[doc = include_str!("../docs/guide/lease.md")]
    mod lease {}
    #[doc = include_str!("../docs/guide/effects.md")]
    mod effects {}
    #[doc = include_str!("../docs/guide/state-machines.md")]
    mod state_machines {}
    #[doc = include_str!("../docs/guide/backends.md")]
    mod backends {}
    #[doc = include_str!("../docs/guide/operations.md")]
    mod operations {}
    #[doc = include_str!("../docs/guide/testing.md")]
    mod testing {}
    #[doc = include_str!("../docs/guide/limitations.md")]
    mod limitations {}
    #[doc = include_str!("../docs/guide/contributing.md")]
    mod contributing {}
}
