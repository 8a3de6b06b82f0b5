//! [`JetStreamSource`]: a durable pull consumer as an inbox source, and [`Consumer`], the
//! inbox runner on it.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures_util::StreamExt;
use idem_core::inbox::{Delivery, Runner, Source};
use idem_core::outbox::{Backoff, DeadLetters};
use idem_core::{BoxError, Error};

use crate::MESSAGE_ID_HEADER;

/// How long a pull request waits for messages; the server's idle heartbeats come every half
/// of it, and two missed ones count as a lost connection.
const PULL_EXPIRES: Duration = Duration::from_secs(10);

/// A durable JetStream pull consumer with explicit acknowledgements, as an inbox
/// [`Source`]: it creates the consumer if it does not exist, and subscribes to it again
/// after a lost connection or a missing stream.
///
/// A delivery's id is the message's `Nats-Msg-Id` (the outbox message id), else
/// `<stream>:<stream sequence>`. Acknowledgements are confirmed by the server
/// (`double_ack`), and so are terminations; a negative acknowledgement carries the runner's
/// delay.
///
/// One message at a time by default (`max_ack_pending` 1), so messages of one aggregate are
/// handled in the order they were published even when one is retried. A clone is not
/// subscribed: it subscribes on its own when its runner starts.
pub struct JetStreamSource {
    jetstream: jetstream::Context,
    stream: String,
    durable: String,
    filter_subject: String,
    ack_wait: Duration,
    max_ack_pending: i64,
    messages: Option<pull::Stream>,
}

impl JetStreamSource {
    /// The durable consumer `durable` on `stream`, for every subject of the stream.
    pub fn new(
        jetstream: jetstream::Context,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        Self {
            jetstream,
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: String::new(),
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1,
            messages: None,
        }
    }

    /// Only messages on `subject` (wildcards allowed).
    #[must_use]
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = subject.into();
        self
    }

    /// How long the server waits for an acknowledgement before redelivering (default 30 s).
    #[must_use]
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Messages in flight at once (default 1: strict order). More is faster but lets a
    /// retried message fall behind later ones.
    #[must_use]
    pub fn max_ack_pending(mut self, max_ack_pending: i64) -> Self {
        self.max_ack_pending = max_ack_pending.max(1);
        self
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        &self.durable
    }
}

impl Clone for JetStreamSource {
    fn clone(&self) -> Self {
        Self {
            jetstream: self.jetstream.clone(),
            stream: self.stream.clone(),
            durable: self.durable.clone(),
            filter_subject: self.filter_subject.clone(),
            ack_wait: self.ack_wait,
            max_ack_pending: self.max_ack_pending,
            // A subscription is one client's: the clone makes its own.
            messages: None,
        }
    }
}

impl fmt::Debug for JetStreamSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamSource")
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter_subject", &self.filter_subject)
            .field("ack_wait", &self.ack_wait)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("subscribed", &self.messages.is_some())
            .finish_non_exhaustive()
    }
}

impl Source for JetStreamSource {
    /// The JetStream message, which acknowledges itself.
    type Receipt = jetstream::Message;

    async fn connect(&mut self) -> Result<(), BoxError> {
        self.messages = None;
        let stream = self.jetstream.get_stream(&self.stream).await?;
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                &self.durable,
                pull::Config {
                    durable_name: Some(self.durable.clone()),
                    filter_subject: self.filter_subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_ack_pending: self.max_ack_pending,
                    ..Default::default()
                },
            )
            .await?;
        // Pull requests that expire after 10 s with a 5 s idle heartbeat (async-nats'
        // defaults: 30 s and 15 s): a half-open connection shows as missed heartbeats after
        // 10 s, and the server stops handing redeliveries to the dead connection's requests
        // 10 s after its last one.
        self.messages = Some(
            consumer
                .stream()
                .expires(PULL_EXPIRES)
                .heartbeat(PULL_EXPIRES / 2)
                .messages()
                .await?,
        );
        Ok(())
    }

    async fn next(&mut self) -> Result<Option<(Delivery, jetstream::Message)>, BoxError> {
        let Some(messages) = self.messages.as_mut() else {
            return Err("not subscribed: connect first".into());
        };
        loop {
            // An error is a missed heartbeat or the like: the runner subscribes again.
            let message = match messages.next().await {
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    if e.kind() == pull::MessagesErrorKind::MissingHeartbeat {
                        // The server's idle heartbeats stopped: the connection may be
                        // half-open (the peer gone without a word), which the client notices
                        // only when three pings went unanswered, three minutes by default,
                        // and every resubscription until then waits on it. Drop it now.
                        tracing::warn!(consumer = %self.durable, "JetStream consumer missed its idle heartbeats; reconnecting");
                        if let Err(e) = self.jetstream.client().force_reconnect().await {
                            tracing::warn!(consumer = %self.durable, error = %e, "JetStream consumer: reconnecting failed");
                        }
                    }
                    return Err(e.into());
                }
                None => return Ok(None),
            };
            match delivery(&self.stream, &message) {
                Ok(delivery) => return Ok(Some((delivery, message))),
                Err(e) => {
                    tracing::warn!(consumer = %self.durable, error = %e, "message without JetStream metadata; terminated");
                    let _ = message.ack_with(AckKind::Term).await;
                }
            }
        }
    }

    async fn ack(&mut self, message: jetstream::Message) -> Result<(), BoxError> {
        message.double_ack().await
    }

    async fn nak(&mut self, message: jetstream::Message, delay: Duration) -> Result<(), BoxError> {
        message.ack_with(AckKind::Nak(Some(delay))).await
    }

    async fn terminate(&mut self, message: jetstream::Message) -> Result<(), BoxError> {
        message.double_ack_with(AckKind::Term).await
    }
}

/// The delivery of a JetStream message of `stream`; an error for a message without
/// JetStream metadata (not from a consumer).
fn delivery(stream: &str, message: &jetstream::Message) -> Result<Delivery, BoxError> {
    let info = message.info()?;
    let headers: Vec<(String, String)> = message
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |v| (name.to_string(), v.as_str().to_owned()))
        })
        .collect();
    let id = headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(MESSAGE_ID_HEADER))
        .map_or_else(
            || format!("{stream}:{}", info.stream_sequence),
            |(_, v)| v.clone(),
        );
    let delivered = u64::try_from(info.delivered).unwrap_or(1);
    let delivery = Delivery::new(id, message.subject.to_string(), message.payload.to_vec())
        .with_delivered(delivered);
    Ok(headers
        .into_iter()
        .fold(delivery, |delivery, (name, value)| {
            delivery.header(name, value)
        }))
}

/// The inbox [`Runner`] on a [`JetStreamSource`], built in one expression: a durable
/// JetStream pull consumer that hands each message to a handler and acknowledges it only
/// after the handler succeeded.
///
/// - `Ok`: acknowledged (and the acknowledgement confirmed by the server). With an
///   `#[idempotent]` handler keyed by [`Delivery::id`], a redelivery replays: no second
///   effect, acknowledged again.
/// - `Err` before `max_deliver` deliveries: negatively acknowledged with a backoff delay.
/// - `Err` at `max_deliver`: recorded in the dead letters, then terminated.
///
/// ```no_run
/// # async fn demo(jetstream: idem_nats::async_nats::jetstream::Context, dead_letters: impl idem_core::outbox::DeadLetters) {
/// # async fn send_receipt(delivery: idem_nats::Delivery) -> Result<(), idem_core::Error> { Ok(()) }
/// idem_nats::Consumer::new(jetstream, "SHOP", "notifier")
///     .filter_subject("shop.orders.paid")
///     .run(send_receipt, &dead_letters, std::future::pending::<()>())
///     .await
///     .unwrap();
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Consumer {
    runner: Runner<JetStreamSource>,
}

impl Consumer {
    /// A consumer named `durable` on `stream`, for every subject of the stream.
    pub fn new(
        jetstream: jetstream::Context,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        let durable = durable.into();
        Self {
            runner: Runner::new(
                durable.clone(),
                JetStreamSource::new(jetstream, stream, durable),
            ),
        }
    }

    /// Only messages on `subject` (wildcards allowed).
    #[must_use]
    pub fn filter_subject(self, subject: impl Into<String>) -> Self {
        self.configure(|source| source.filter_subject(subject))
    }

    /// Deliveries before a failing message is dead-lettered (default 5, at least 1).
    #[must_use]
    pub fn max_deliver(self, max_deliver: u64) -> Self {
        Self {
            runner: self.runner.max_deliver(max_deliver),
        }
    }

    /// How long the server waits for an acknowledgement before redelivering (default 30 s).
    #[must_use]
    pub fn ack_wait(self, ack_wait: Duration) -> Self {
        self.configure(|source| source.ack_wait(ack_wait))
    }

    /// Messages in flight at once (default 1: strict order). More is faster but lets a
    /// retried message fall behind later ones.
    #[must_use]
    pub fn max_ack_pending(self, max_ack_pending: i64) -> Self {
        self.configure(|source| source.max_ack_pending(max_ack_pending))
    }

    /// Delays of negative acknowledgements and resubscriptions (default 200 ms doubling to
    /// 30 s, with jitter).
    #[must_use]
    pub fn backoff(self, backoff: Backoff) -> Self {
        Self {
            runner: self.runner.backoff(backoff),
        }
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        self.runner.name()
    }

    /// The runner this consumer is.
    pub fn into_runner(self) -> Runner<JetStreamSource> {
        self.runner
    }

    /// Consumes until `shutdown` completes. Lost connections and missing streams are logged
    /// and retried; they never end the loop. A message being handled is finished first.
    pub async fn run<H, Fut, T, E, D>(
        &self,
        handler: H,
        dead_letters: &D,
        shutdown: impl Future,
    ) -> Result<(), Error>
    where
        H: Fn(Delivery) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
        D: DeadLetters,
    {
        let mut runner = self.runner.clone();
        runner.run(handler, dead_letters, shutdown).await
    }

    /// Changes the source's settings through its own builder methods. (Nothing is
    /// subscribed before `run`, so the clone this takes loses nothing.)
    fn configure(mut self, change: impl FnOnce(JetStreamSource) -> JetStreamSource) -> Self {
        let source = self.runner.source_mut();
        *source = change(source.clone());
        self
    }
}
