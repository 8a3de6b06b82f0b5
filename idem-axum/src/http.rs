//! The `Idempotency-Key` extractor, problem+json errors, `If-Match` and `ETag`, and
//! [`respond`] and [`respond_answer`], which answer an idempotent call (and mark its replays).

use std::future::Future;

use axum_core::response::{IntoResponse, Response};
use http::StatusCode;
use serde::Serialize;

use idem_core::{EntityTag, Outcome, with_outcome};
use idem_http::JsonAnswer;
pub use idem_http::{
    Answer, ETag, IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_FIELD, IDEMPOTENT_REPLAYED, IdempotencyKey,
    IfMatch, Keyed, Problem, ReplayStatus, run_to_completion,
};

/// Runs an idempotent call **to completion on a task of its own** and answers it: `Ok(value)`
/// as JSON with `status`, `Err(e)` as `e`'s response (for an idem [`Error`](idem_core::Error), map it to a
/// [`Problem`]: `.map_err(Problem::from)`); a replayed answer (value or recorded
/// final error) carries `Idempotent-Replayed: true`, a first execution does not.
///
/// Because the recorded value is replayed and rendered the same way, a replay returns the
/// originally recorded status and body. Shorthand for `Respond::new(status).run(call)`; see
/// [`Respond`] for replays answered with 200 and for an `ETag` taken from the value.
///
/// # A client that hangs up does not cut the call off
///
/// axum (hyper) drops a handler's future when its client disconnects. Dropped mid-call, a
/// handler's statement can be cut off in flight, and with sqlx 0.9 that can return its
/// pooled connection *inside a transaction* (PostgreSQL: later, unrelated requests run in a
/// stale transaction) or lose it for good (MariaDB: the pool shrinks); in lease mode the key
/// also stays claimed until its lease ends, so the client's retry waits and gets 409
/// (docs/RELIABILITY.md, finding 2). `respond` therefore spawns the call (and the rendering
/// of its answer) on a tokio task: once started, the call finishes whatever the client
/// does, its answer is recorded, and the client's retry replays it. Only the wait for the
/// answer is dropped with the handler. That is why `call` must be `Send + 'static`: pass it
/// owned or cloned state (`async move { pay(&app.db, key, order).await }` with `app` an
/// owned clone of the router state), not borrows of the handler's arguments.
///
/// The call is polled once in place first: one answered without waiting (a replay of an
/// answer this process keeps in memory) needs no task (see `idem::http::spawn_and_wait`).
/// The task runs inside the current tracing span. Do not rely on the handler's task-locals
/// inside the call: the outcome that sets the replay header is tracked inside it, so an
/// outer [`with_outcome`] around `respond` sees no outcome. A panic in the call is resumed in
/// the handler, as if the call had run there. Outside a tokio runtime the call runs in place.
///
/// Use [`respond_inline`] (or [`Respond::run_inline`]) for a call that borrows: it is
/// cancelled with the handler.
pub fn respond<T, E, F>(status: StatusCode, call: F) -> impl Future<Output = Response>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Serialize + 'static,
    E: IntoResponse + 'static,
{
    Respond::new(status).run(call)
}

/// Runs an idempotent call whose value is an [`Answer`] (a `303 See Other` with its
/// `Location`, a rendered page, a flash cookie) **to completion on a task of its own**, as
/// [`respond`] does, and answers it as it was recorded: its status, headers and body, with
/// `Idempotent-Replayed: true` on a replay. `Err(e)` is `e`'s response, marked on a replay of
/// a recorded final error too.
///
/// ```text
/// async fn publish(State(app): State<AppState>, Keyed(key, Form(form)): Keyed<Form<PublishForm>>) -> Response {
///     // publish_issue returns Ok(Answer::see_other("/admin/newsletters").set_cookie(flash))
///     respond_answer(async move { publish_issue(&app.pool, key, form).await }).await
/// }
/// ```
pub fn respond_answer<E, F>(call: F) -> impl Future<Output = Response>
where
    F: Future<Output = Result<Answer, E>> + Send + 'static,
    E: IntoResponse + 'static,
{
    run_to_completion(async move {
        let (result, outcome) = with_outcome(call).await;
        let replayed = outcome == Some(Outcome::Replayed);
        match result {
            Ok(answer) => answer
                .to_response(replayed)
                .map(axum_core::body::Body::from),
            Err(e) => error_response(e, replayed),
        }
    })
}

/// An error's own response, marked `Idempotent-Replayed: true` when it is a recorded final
/// error replayed.
fn error_response(e: impl IntoResponse, replayed: bool) -> Response {
    let mut response = e.into_response();
    if replayed {
        idem_http::mark_replayed(response.headers_mut());
    }
    response
}

/// [`respond`] without the task: the call runs inside the handler's future, so it needs
/// neither `Send` nor `'static`, and it is **cancelled when the client disconnects**.
///
/// Only for calls that cannot be made `'static`, or whose bodies run no statement that a
/// drop could cut off: with sqlx 0.9 a handler statement dropped in flight can leave its
/// pooled connection in a transaction (PostgreSQL) or lose it (MariaDB), and a lease-mode
/// key stays claimed until its lease ends. Prefer [`respond`].
pub async fn respond_inline<T, E, F>(status: StatusCode, call: F) -> Response
where
    F: Future<Output = Result<T, E>>,
    T: Serialize,
    E: IntoResponse,
{
    Respond::new(status).run_inline(call).await
}

/// How to answer an idempotent call over HTTP: [`respond`] with options.
///
/// ```
/// use idem_axum::{ReplayStatus, Respond};
/// use http::StatusCode;
///
/// // 201 for the first execution, 200 for its replays.
/// let created = Respond::<String>::new(StatusCode::CREATED).replay_status(ReplayStatus::Ok);
/// # let _ = created;
/// ```
///
/// In a handler: `Respond::new(StatusCode::CREATED).replay_status(ReplayStatus::Ok).run(async move { place_order(&db, key, new).await }).await`,
/// or, to send the `ETag` of the written row,
/// `Respond::new(StatusCode::OK).etag(OrderView::etag).run(async move { change_note(&db, key, id, if_match, patch).await }).await`.
#[must_use = "a `Respond` does nothing until `.run(call)` is awaited"]
pub struct Respond<T>(JsonAnswer<T>);

impl<T> std::fmt::Debug for Respond<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Respond").field(&self.0).finish()
    }
}

impl<T> Clone for Respond<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Respond<T> {}

impl<T: Serialize> Respond<T> {
    /// Answers a value with `status` (and a replayed value with the same status, unless
    /// [`replay_status`](Self::replay_status) says otherwise).
    pub const fn new(status: StatusCode) -> Self {
        Self(JsonAnswer::new(status))
    }

    /// Chooses the status of replayed values.
    pub const fn replay_status(self, policy: ReplayStatus) -> Self {
        Self(self.0.replay_status(policy))
    }

    /// Sends `ETag: <etag(&value)>` with every value, first execution and replay alike (a
    /// replay's tag is the one the first answer had, taken from the recorded value).
    pub const fn etag(self, etag: fn(&T) -> EntityTag) -> Self {
        Self(self.0.etag(etag))
    }

    /// Runs the idempotent call to completion on a task of its own and answers it: the value
    /// as JSON, an error as its own response, a replay with `Idempotent-Replayed: true`. A
    /// client that hangs up stops only the wait, never the call (see [`respond`]).
    pub fn run<E, F>(self, call: F) -> impl Future<Output = Response>
    where
        T: 'static,
        E: IntoResponse + 'static,
        F: Future<Output = Result<T, E>> + Send + 'static,
    {
        run_to_completion(self.run_inline(call))
    }

    /// [`run`](Self::run) inside the handler's own future: no `Send` or `'static` needed, and
    /// the call is **cancelled when the client disconnects** (see [`respond_inline`]).
    pub async fn run_inline<E, F>(self, call: F) -> Response
    where
        F: Future<Output = Result<T, E>>,
        E: IntoResponse,
    {
        let (result, outcome) = with_outcome(call).await;
        let replayed = outcome == Some(Outcome::Replayed);
        match result {
            Ok(value) => self
                .0
                .answer(&value, replayed)
                .map(axum_core::body::Body::from),
            Err(e) => error_response(e, replayed),
        }
    }
}

#[cfg(test)]
mod tests {
    use idem_core::atomic::run;
    use idem_core::call::handler::{FinalProbe, ViaFinal};
    use idem_core::call::{Call, Site};
    use idem_core::{Concurrency, FinalError, MemoryStore, MemoryTx};
    use std::time::Duration;

    use http::HeaderValue;
    use http::header::ETAG;
    use http::header::{IF_MATCH, RETRY_AFTER};
    use http::request::Parts;
    use idem_core::Error;

    use super::*;

    /// A call whose `respond` future is dropped mid-way (the client hung up) still finishes;
    /// under `respond_inline` it is cancelled with the handler.
    #[tokio::test]
    async fn a_dropped_respond_still_finishes_its_call() {
        for spawned in [true, false] {
            let gate = std::sync::Arc::new(tokio::sync::Notify::new());
            let (done, finished) = tokio::sync::oneshot::channel();
            let open = gate.clone();
            let call = async move {
                open.notified().await;
                let _ = done.send(());
                Ok::<_, Problem>(1)
            };
            let waiting = tokio::time::Duration::from_millis(20);
            let dropped = if spawned {
                tokio::time::timeout(waiting, respond(StatusCode::OK, call)).await
            } else {
                tokio::time::timeout(waiting, respond_inline(StatusCode::OK, call)).await
            };
            assert!(dropped.is_err(), "the call waits at its gate");
            gate.notify_one();
            let outcome = tokio::time::timeout(waiting * 50, finished).await;
            assert_eq!(matches!(outcome, Ok(Ok(()))), spawned, "spawned: {spawned}");
        }
    }

    /// The handler holds only a pointer to the call: a call's future can be tens of KiB in
    /// debug builds, and a handler future holding it inline (several times over, once per
    /// wrapping `async fn`) overflowed a test thread's stack.
    #[test]
    fn respond_keeps_the_call_off_the_handlers_future() {
        let call = async {
            let ballast = [0_u8; 16 * 1024];
            tokio::task::yield_now().await;
            Ok::<_, Problem>(ballast.len())
        };
        assert!(std::mem::size_of_val(&call) >= 16 * 1024);
        let answer = respond(StatusCode::OK, call);
        assert!(
            std::mem::size_of_val(&answer) <= 64,
            "{}",
            std::mem::size_of_val(&answer)
        );
    }

    #[tokio::test]
    async fn a_panic_in_a_spawned_call_reaches_the_handler() {
        let handler = tokio::spawn(respond(StatusCode::OK, async {
            panic!("in the call");
            #[allow(unreachable_code)]
            Ok::<u8, Problem>(0)
        }));
        let e = handler.await.expect_err("the handler panicked");
        let message = e.into_panic();
        assert_eq!(message.downcast_ref::<&str>(), Some(&"in the call"));
    }

    #[test]
    fn a_call_past_its_deadline_is_503_with_retry_after_and_its_own_type() {
        let e = Error::DeadlineExceeded {
            scope: "orders.pay".to_owned(),
            deadline: std::time::Duration::from_secs(300),
            retry_after: std::time::Duration::from_secs(1),
        };
        let response = Problem::from(&e).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            response
                .headers()
                .get(RETRY_AFTER)
                .map(HeaderValue::as_bytes),
            Some(&b"1"[..])
        );
        let problem = Problem::from(&e);
        assert_eq!(problem.kind, "urn:idem:problem:deadline-exceeded");
        assert!(problem.detail.contains("same key"), "{}", problem.detail);
    }

    #[test]
    fn parses_structured_field_strings_and_tokens() {
        let parse = |v: &str| IdempotencyKey::parse(v.as_bytes()).map(|k| k.0.as_str().to_owned());
        assert_eq!(parse("\"8e03978e-40d5\"").unwrap(), "8e03978e-40d5");
        assert_eq!(parse("8e03978e-40d5").unwrap(), "8e03978e-40d5");
        assert_eq!(parse(r#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert!(parse("\"\"").is_err());
        assert!(parse(r#""bad\escape""#).is_err());
        assert!(parse(r#""in"side""#).is_err());
        assert!(IdempotencyKey::parse(b"\xff").is_err());
    }

    fn if_match_of(parts: &Parts) -> Result<Option<idem_core::IfMatch>, Error> {
        idem_http::if_match(&parts.headers)
    }

    fn parts_with(if_match: &[&str]) -> Parts {
        let mut request = http::Request::builder();
        for value in if_match {
            request = request.header(IF_MATCH, *value);
        }
        request.body(()).expect("request").into_parts().0
    }

    #[test]
    fn if_match_lines_are_one_list_and_absence_is_428() {
        assert_eq!(if_match_of(&parts_with(&[])).expect("absent"), None);
        assert_eq!(
            if_match_of(&parts_with(&["\"1\"", "W/\"2\", \"3\""])).expect("lines"),
            Some(idem_http::parse_if_match("\"1\", W/\"2\", \"3\"").expect("list"))
        );
        let mixed = if_match_of(&parts_with(&["*", "\"1\""])).expect_err("`*` and a tag");
        assert_eq!(mixed.http_status(), 400);
        let p = Problem::from(&Error::PreconditionRequired);
        assert_eq!(
            (p.status, p.kind.as_str()),
            (428, "urn:idem:problem:precondition-required")
        );
        let p = Problem::from(&Error::PreconditionFailed {
            current: Some(EntityTag::from_version(4)),
        });
        assert_eq!(
            (p.status, p.kind.as_str()),
            (412, "urn:idem:problem:precondition-failed")
        );
        assert!(p.detail.contains("\"4\""), "{}", p.detail);
    }

    static SITE: Site = Site::new(
        "idem-axum.tests",
        Duration::from_secs(60),
        Concurrency::Reject,
    );

    /// A handler's refusal that is recorded and replayed, as a final error is.
    #[derive(Debug, Serialize, serde::Deserialize)]
    struct Refused(String);

    impl FinalError for Refused {
        fn is_final(&self) -> bool {
            true
        }
    }

    impl From<Error> for Refused {
        fn from(e: Error) -> Self {
            Self(e.to_string())
        }
    }

    impl IntoResponse for Refused {
        fn into_response(self) -> Response {
            Problem::new(409, "refused", "Refused", self.0).into_response()
        }
    }

    /// An idempotent call of the engine under `key` of `store` that answers `result`: the
    /// first call with a key executes, later ones replay what it recorded.
    fn call<T>(
        store: &MemoryStore,
        key: &str,
        result: Result<T, Refused>,
    ) -> impl Future<Output = Result<T, Refused>> + Send + 'static
    where
        T: Serialize + serde::de::DeserializeOwned + Send + 'static,
    {
        let call = Call::new(&SITE, key);
        let finality = (&FinalProbe::<Refused>::new()).finality();
        // The memory store never conflicts: the body is made once.
        let mut result = Some(result);
        run(store.clone(), call, finality, move || {
            let result = result.take().expect("one try");
            Ok(async move |_tx: &MemoryTx| result)
        })
    }

    #[tokio::test]
    async fn replay_status_ok_answers_replayed_values_with_200_and_keeps_error_statuses() {
        let store = MemoryStore::new();
        let created = Respond::new(StatusCode::CREATED).replay_status(ReplayStatus::Ok);
        let first = created.run(call(&store, "value", Ok(1))).await;
        assert_eq!(first.status(), StatusCode::CREATED);
        assert!(first.headers().get(IDEMPOTENT_REPLAYED).is_none());
        let replay = created.run(call(&store, "value", Ok(1))).await;
        assert_eq!(replay.status(), StatusCode::OK);
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        let refused = || Err(Refused("from Paid to Cancelled".into()));
        let recorded = created.run(call::<i32>(&store, "refused", refused())).await;
        assert_eq!(recorded.status(), StatusCode::CONFLICT);
        let replayed_error = created.run(call::<i32>(&store, "refused", refused())).await;
        assert_eq!(replayed_error.status(), StatusCode::CONFLICT);
        assert_eq!(replayed_error.headers()[IDEMPOTENT_REPLAYED], "true");

        let original = respond(StatusCode::CREATED, call(&store, "value", Ok(1))).await;
        assert_eq!(original.status(), StatusCode::CREATED, "the default");
    }

    #[tokio::test]
    async fn respond_sends_the_etag_of_the_value() {
        let store = MemoryStore::new();
        let tagged = Respond::new(StatusCode::OK).etag(|v: &i64| EntityTag::from_version(*v));
        let first = tagged.run(call(&store, "tagged", Ok(5))).await;
        assert_eq!(first.headers()[ETAG], "\"5\"");
        let replay = tagged.run(call(&store, "tagged", Ok(5))).await;
        assert_eq!(replay.headers()[ETAG], "\"5\"", "a replay's tag too");
        let failed = tagged
            .run(async { Err::<i64, _>(Problem::from(Error::PreconditionRequired)) })
            .await;
        assert_eq!(failed.status(), StatusCode::PRECONDITION_REQUIRED);
        assert!(failed.headers().get(ETAG).is_none(), "no tag on an error");
    }

    #[test]
    fn etag_and_retry_after_headers() {
        let tagged = (ETag(EntityTag::from_version(3)), ()).into_response();
        assert_eq!(tagged.headers()[ETAG], "\"3\"");
        let in_flight = Problem::from(Error::InFlight {
            scope: "s".into(),
            retry_after: Duration::from_millis(1500),
        })
        .into_response();
        assert_eq!(in_flight.status(), StatusCode::CONFLICT);
        assert_eq!(in_flight.headers()[RETRY_AFTER], "2");
    }

    #[test]
    fn the_if_match_extractor_is_fingerprinted_as_the_precondition() {
        let precondition = idem_http::parse_if_match("\"1\", W/\"2\"").expect("list");
        let extracted = IfMatch(precondition.clone());
        assert_eq!(
            serde_json::to_string(&extracted).expect("json"),
            serde_json::to_string(&precondition).expect("json")
        );
        let deref: &idem_core::IfMatch = &extracted;
        assert_eq!(deref, &precondition);
    }

    #[test]
    fn problems_have_stable_types_and_statuses() {
        let p = Problem::from(&Error::KeyReused { scope: "s".into() });
        assert_eq!(
            (p.status, p.kind.as_str()),
            (422, "urn:idem:problem:key-reused")
        );
        let store = Error::store("x", std::io::Error::other("SELECT secret FROM t"));
        let p = Problem::from(&store);
        assert_eq!(p.status, 503);
        assert!(!p.detail.contains("SELECT"));
    }

    #[test]
    fn answers_a_process_cannot_read_have_their_own_problems() {
        let too_new = Error::AnswerTooNew {
            scope: "s".into(),
            key_hash: "79ee16353aabc958".into(),
            recorded: 3,
            known: 2,
            retry_after: idem_core::versioned::NEWER_RETRY_AFTER,
        };
        let p = Problem::from(&too_new);
        assert_eq!(
            (p.status, p.kind.as_str()),
            (503, "urn:idem:problem:answer-too-new")
        );
        let response = p.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "2");

        let unreadable = Error::AnswerUnreadable {
            scope: "s".into(),
            key_hash: "79ee16353aabc958".into(),
            recorded: 1,
            expected: 2,
            source: "missing field `currency`".into(),
        };
        let p = Problem::from(&unreadable);
        assert_eq!(
            (p.status, p.kind.as_str()),
            (410, "urn:idem:problem:answer-unreadable")
        );
        assert!(p.retry_after.is_none());
        assert!(p.detail.contains("new key"), "{}", p.detail);
        assert!(
            !p.detail.contains("currency"),
            "no field names: {}",
            p.detail
        );
    }
}
