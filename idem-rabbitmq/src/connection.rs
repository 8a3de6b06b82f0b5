//! Connections: one per sink or source, opened on first use and again after it broke.

use std::time::Duration;

use lapin::{Channel, Connection, ConnectionProperties};

/// How long opening a connection may take: a broker that accepts TCP but does not answer
/// (stopped, overloaded) is an error the caller retries, not a hang.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The heartbeat idem asks for when the URI names none, in seconds. A connection whose peer
/// went away without a word (a half-open TCP connection) is only noticed when heartbeats
/// lapse: RabbitMQ's own default (60 s) left a consumer waiting on one for two minutes.
const HEARTBEAT_SECONDS: u16 = 10;

/// `uri` with `heartbeat=` [`HEARTBEAT_SECONDS`] added to its query unless it names one.
fn with_heartbeat(uri: &str) -> std::borrow::Cow<'_, str> {
    let query = uri.split_once('?').map_or("", |(_, query)| query);
    if query.split('&').any(|pair| pair.starts_with("heartbeat=")) {
        return uri.into();
    }
    let separator = if uri.contains('?') { '&' } else { '?' };
    format!("{uri}{separator}heartbeat={HEARTBEAT_SECONDS}").into()
}

/// Opens a connection to `uri` (`amqp://user:password@host:port/vhost`), with a 10 s
/// heartbeat unless the URI asks for another (`?heartbeat=N`; 0 turns them off).
pub(crate) async fn open(uri: &str) -> Result<Connection, lapin::Error> {
    let properties = ConnectionProperties::default().with_connection_name("idem".into());
    let uri = with_heartbeat(uri);
    match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(&uri, properties)).await {
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

/// Opens a connection and a channel on it, set up by `setup` (confirm mode, a consumer). A
/// broker can take the connection and then not answer the channel's opening (it is still
/// booting, or it hangs): the setup is bounded like the connect, and a connection whose
/// setup failed is closed.
pub(crate) async fn open_channel<T>(
    uri: &str,
    setup: impl AsyncFnOnce(&Channel) -> Result<T, lapin::Error>,
) -> Result<(Connection, Channel, T), lapin::Error> {
    let connection = open(uri).await?;
    let opened = tokio::time::timeout(CONNECT_TIMEOUT, async {
        let channel = connection.create_channel().await?;
        let set_up = setup(&channel).await?;
        Ok::<_, lapin::Error>((channel, set_up))
    })
    .await
    .unwrap_or_else(|_| Err(timed_out("opening a channel")));
    match opened {
        Ok((channel, set_up)) => Ok((connection, channel, set_up)),
        Err(e) => {
            forget(connection);
            Err(e)
        }
    }
}

/// Closes a connection idem no longer uses, in the background and bounded: a broker that
/// hangs never answers the close, and must not hold up the caller that gave up on it.
pub(crate) fn forget(connection: Connection) {
    tokio::spawn(async move {
        let closing = connection.close(200, "idem: reconnecting".into());
        let _ = tokio::time::timeout(CONNECT_TIMEOUT, closing).await;
    });
}

#[cfg(test)]
mod tests {
    use super::with_heartbeat;

    #[test]
    fn a_heartbeat_is_asked_for_unless_the_uri_names_one() {
        let base = "amqp://guest:guest@127.0.0.1:5672/%2f";
        assert_eq!(with_heartbeat(base), format!("{base}?heartbeat=10"));
        assert_eq!(
            with_heartbeat(&format!("{base}?frame_max=8192")),
            format!("{base}?frame_max=8192&heartbeat=10")
        );
        for named in [
            format!("{base}?heartbeat=0"),
            format!("{base}?frame_max=8192&heartbeat=30"),
        ] {
            assert_eq!(with_heartbeat(&named), named);
        }
    }
}
