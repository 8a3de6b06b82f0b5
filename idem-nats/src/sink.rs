//! [`JetStreamSink`]: the outbox relay's sink for JetStream.

use async_nats::jetstream;
use idem_core::Error;
use idem_core::outbox::{OutboxMessage, Sink, SinkError};

use crate::{AGGREGATE_HEADER, AGGREGATE_SEQ_HEADER, MESSAGE_ID_HEADER};

/// Publishes outbox messages to JetStream: the topic is the subject, the message id goes in
/// `Nats-Msg-Id` (and the aggregate and its sequence number in `Idem-Aggregate` and
/// `Idem-Aggregate-Seq`), and a publish counts once the stream acknowledged it (a duplicate's
/// acknowledgement too).
#[derive(Debug, Clone)]
pub struct JetStreamSink {
    jetstream: jetstream::Context,
}

impl JetStreamSink {
    /// A sink on `jetstream`. A stream must capture the topics (see [`ensure_stream`]).
    pub fn new(jetstream: jetstream::Context) -> Self {
        Self { jetstream }
    }
}

impl Sink for JetStreamSink {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), SinkError> {
        let mut headers = async_nats::HeaderMap::new();
        for (name, value) in &message.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        headers.insert(MESSAGE_ID_HEADER, message.id.as_str());
        if let (Some(aggregate), Some(seq)) = (&message.aggregate, message.aggregate_seq) {
            headers.insert(AGGREGATE_HEADER, aggregate.as_str());
            headers.insert(AGGREGATE_SEQ_HEADER, seq.to_string());
        }
        let ack = self
            .jetstream
            .publish_with_headers(
                message.topic.clone(),
                headers,
                message.payload.clone().into(),
            )
            .await
            .map_err(|e| SinkError::transient(format!("publishing to JetStream: {e}")))?;
        ack.await
            .map_err(|e| SinkError::transient(format!("waiting for JetStream's ack: {e}")))?;
        Ok(())
    }

    /// Makes the client drop its connection and connect again (async-nats'
    /// `force_reconnect`), for a connection that looks alive and carries nothing.
    async fn reconnect(&self) {
        if let Err(e) = self.jetstream.client().force_reconnect().await {
            tracing::warn!(error = %e, "JetStream sink: reconnecting failed");
        }
    }
}

/// Creates stream `name` capturing `subjects` if it does not exist (file storage, the
/// server's defaults otherwise, including the 2-minute duplicate window).
pub async fn ensure_stream(
    jetstream: &jetstream::Context,
    name: &str,
    subjects: &[&str],
) -> Result<(), Error> {
    jetstream
        .get_or_create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        })
        .await
        .map(drop)
        .map_err(|e| Error::store(format!("creating JetStream stream `{name}`"), e))
}
