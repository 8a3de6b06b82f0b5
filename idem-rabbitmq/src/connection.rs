//! Connections: one per sink or source, opened on first use and again after it broke.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

/// How long opening a connection may take: a broker that accepts TCP but does not answer
/// (stopped, overloaded) is an error the caller retries, not a hang.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens a connection to `uri` (`amqp://user:password@host:port/vhost`).
pub(crate) async fn open(uri: &str) -> Result<Connection, lapin::Error> {
    let properties = ConnectionProperties::default().with_connection_name("idem".into());
    match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(uri, properties)).await {
        Ok(connection) => connection,
        Err(_) => Err(timed_out("connecting")),
    }
}

/// The error of a step (`what`) the broker did not answer within [`CONNECT_TIMEOUT`].
pub(crate) fn timed_out(what: &str) -> lapin::Error {
    lapin::Error::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what}: no answer from RabbitMQ within {CONNECT_TIMEOUT:?}"),
    ))
}
