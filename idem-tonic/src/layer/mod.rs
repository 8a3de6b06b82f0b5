//! [`IdempotencyLayer`]: a tower layer that makes unary gRPC methods of a tonic server
//! idempotent by recording their whole answers, for methods not written over
//! `#[idempotent]` domain functions.

mod body;
mod message;
mod recorded;
mod service;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use idem_core::LeaseStore;
use idem_core::call::Site;
use idem_http::recording::Recording;
use serde::Serialize;

pub use service::IdempotencyService;

/// Records the whole answer of unary gRPC methods (message, metadata, status) on the idem
/// ledger, so a retry with the same `idempotency-key` metadata gets the recorded answer
/// instead of running the method again: the gRPC twin of `idem::axum::IdempotencyLayer`,
/// on the same ledger.
///
/// ```text
/// let layer = IdempotencyLayer::new(SeaOrmLeaseStore::new(db.clone()))
///     .method::<PayRequest>("/shop.Payments/Pay");
/// Server::builder().layer(layer).add_service(PaymentsServer::new(service)).serve(addr).await?;
/// ```
///
/// Only the methods named with [`method`](Self::method) are recorded; every other call
/// passes through untouched. Each method's scope is its path without the leading `/`
/// (`shop.Payments/Pay`), which is stable for as long as the API is.
///
/// **The fingerprint is the decoded message**, not its bytes: protobuf encodings of one
/// message differ (field order, map order, which changes between client processes, packed or
/// not, default values sent or omitted), so the layer decodes the request as the method's
/// message type `M` and fingerprints it as `#[idempotent]` fingerprints an argument (serde,
/// maps sorted). `M` is the prost message (with `#[derive(serde::Serialize)]`: with
/// tonic-build, `.type_attribute(".", "#[derive(serde::Serialize)]")`).
///
/// | call | answer |
/// |---|---|
/// | no `idempotency-key`, or a malformed or repeated one | `INVALID_ARGUMENT`, the method does not run |
/// | a message that does not decode as `M`, or a stream of several | `INVALID_ARGUMENT`, nothing claimed |
/// | a compressed request message | `UNIMPLEMENTED`, nothing claimed (let clients send uncompressed) |
/// | a request over [`max_request_body`](Self::max_request_body) | `RESOURCE_EXHAUSTED`, nothing claimed |
/// | same key, another message or method | `FAILED_PRECONDITION` (`idem-problem: key-reused`) |
/// | same key while the first call runs | `ABORTED` + `retry-after` / `grpc-retry-pushback-ms` (or wait: [`on_concurrent`](Self::on_concurrent)) |
/// | same key after a recorded answer | the recorded message, metadata and status + `idempotent-replayed: true` |
/// | the method answers `OK` or a status the client must act on (`INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNAUTHENTICATED`) | recorded and replayed |
/// | the method answers any other status (`UNAVAILABLE`, `INTERNAL`, `ABORTED`, …) | passed through; nothing is recorded and the key is free at once |
/// | the method panics | `INTERNAL`; the lease is left to expire, then a retry runs the method again |
/// | the answer is over [`max_response_body`](Self::max_response_body) | the first client gets it whole; a retry gets `INTERNAL` (`response-not-recorded`), never a second execution |
/// | store unavailable | `UNAVAILABLE` + retry delay, the method does not run |
///
/// Calls are claimed in **lease mode**: the claim commits first, the method runs outside any
/// ledger transaction, on a task of its own (a client that cancels does not cancel it), and
/// its answer is recorded if the lease still holds.
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

#[derive(Clone)]
struct Config {
    recording: Recording,
    methods: HashMap<String, Method>,
    principal: Option<Principal>,
}

/// A recorded method: its site and how its request message is fingerprinted.
#[derive(Clone, Copy)]
struct Method {
    site: &'static Site,
    fingerprint: message::Fingerprint,
}

type Principal = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let mut methods: Vec<&String> = c.methods.keys().collect();
        methods.sort();
        let mut f = f.debug_struct("IdempotencyLayer");
        f.field("methods", &methods);
        c.recording.debug_fields(&mut f);
        f.field("principal", &c.principal.is_some())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// The default limit of a recorded answer and of a fingerprinted request: 1 MiB.
    pub const DEFAULT_MAX_BODY: usize = Recording::DEFAULT_MAX_BODY;

    /// The default memory for answers replayed without reading the ledger: 8 MiB.
    pub const DEFAULT_REMEMBERED: usize = Recording::DEFAULT_REMEMBERED;

    /// A layer recording the answers of the methods named with [`method`](Self::method) in
    /// `store`, the ledger's lease store (with SeaORM: `idem::sea_orm::SeaOrmLeaseStore::new(db)`).
    ///
    /// Defaults: answers kept 24 h, leases of 30 s, a duplicate in flight answered `ABORTED`
    /// at once, messages up to [`DEFAULT_MAX_BODY`](Self::DEFAULT_MAX_BODY),
    /// [`DEFAULT_REMEMBERED`](Self::DEFAULT_REMEMBERED) of recent answers replayed from memory.
    pub fn new(store: impl LeaseStore) -> Self {
        Self {
            config: Arc::new(Config {
                recording: Recording::new(store),
                methods: HashMap::new(),
                principal: None,
            }),
        }
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        change(config);
        for method in config.methods.values_mut() {
            method.site = config.recording.site(method.site.scope());
        }
        self
    }

    fn with_recording(self, change: impl FnOnce(&mut Recording)) -> Self {
        self.with(|c| change(&mut c.recording))
    }

    idem_http::recording_settings!();

    /// Records the unary method at `path` (`/package.Service/Method`, as tonic routes it),
    /// whose request message is `M`. Its scope is the path without the leading `/`.
    ///
    /// # Panics
    ///
    /// If `path` is not of the form `/package.Service/Method`: a configuration mistake, found
    /// when the server is built.
    pub fn method<M>(self, path: &str) -> Self
    where
        M: prost::Message + Default + Serialize + 'static,
    {
        let scope = match path.strip_prefix('/') {
            Some(scope) if scope.split('/').count() == 2 && !scope.contains("//") => scope,
            _ => panic!(
                "IdempotencyLayer::method: {path:?} is not a gRPC method path such as \"/shop.Payments/Pay\""
            ),
        };
        let scope = scope.to_owned();
        let path = path.to_owned();
        self.with(move |c| {
            let method = Method {
                site: c.recording.site(&scope),
                fingerprint: message::fingerprint_as::<M>,
            };
            c.methods.insert(path, method);
        })
    }

    /// Who the key belongs to (tenant, user, API client), read from the request's head (its
    /// metadata are the headers; an authentication layer's extensions are there too): keys
    /// of two principals never meet. A principal that is not a valid key is
    /// `INVALID_ARGUMENT`.
    pub fn principal<F>(self, principal: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|c| c.principal = Some(Arc::new(principal)))
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::clone(&self.config))
    }
}
