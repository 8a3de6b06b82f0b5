//! The bench's HTTP/1.1 client for P11: one keep-alive connection, one request at a time,
//! written and read by hand so the client adds as little as it can to what it times (a
//! general client's pool, timers and header maps would be the same for every contender, but
//! would flatten the ratios between them).

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufStream};
use tokio::net::TcpStream;

use crate::Res;

/// The longest response head or body the bench expects (its routes answer a few hundred
/// bytes); anything longer is a fault, not a figure.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// One keep-alive connection to the bench's server.
#[derive(Debug)]
pub(crate) struct Connection {
    stream: BufStream<TcpStream>,
    request: Vec<u8>,
    /// The last answer's body (the soak reads the ids it answers).
    body: Vec<u8>,
}

/// What the bench reads from an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    /// The answer says it is a replay (`Idempotent-Replayed` from idem,
    /// `Idempotency-Replayed` from the peer).
    pub(crate) replayed: bool,
}

/// A request: the route's path, its headers (`Idempotency-Key`, `Cookie`) and a JSON body.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Post<'a> {
    pub(crate) path: &'a str,
    pub(crate) key: Option<&'a str>,
    pub(crate) cookie: Option<&'a str>,
    pub(crate) body: &'a [u8],
}

impl Connection {
    pub(crate) async fn open(addr: std::net::SocketAddr) -> Res<Self> {
        let stream = TcpStream::connect(addr).await?;
        // A request goes out as soon as it is written, whatever the last one's ACK did.
        stream.set_nodelay(true)?;
        Ok(Self {
            stream: BufStream::new(stream),
            request: Vec::with_capacity(2048),
            body: Vec::with_capacity(2048),
        })
    }

    /// Sends `post` and reads the whole answer.
    pub(crate) async fn post(&mut self, post: Post<'_>) -> Res<Answer> {
        self.request.clear();
        let r = &mut self.request;
        r.extend_from_slice(b"POST ");
        r.extend_from_slice(post.path.as_bytes());
        r.extend_from_slice(b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n");
        if let Some(key) = post.key {
            r.extend_from_slice(b"idempotency-key: ");
            r.extend_from_slice(key.as_bytes());
            r.extend_from_slice(b"\r\n");
        }
        if let Some(cookie) = post.cookie {
            r.extend_from_slice(b"cookie: ");
            r.extend_from_slice(cookie.as_bytes());
            r.extend_from_slice(b"\r\n");
        }
        r.extend_from_slice(format!("content-length: {}\r\n\r\n", post.body.len()).as_bytes());
        r.extend_from_slice(post.body);
        self.stream.write_all(&self.request).await?;
        self.stream.flush().await?;
        self.read_answer().await
    }

    async fn read_answer(&mut self) -> Res<Answer> {
        let mut line = String::new();
        self.read_line(&mut line).await?;
        // "HTTP/1.1 201 Created"
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| format!("not an HTTP status line: {line:?}"))?;
        let (mut length, mut chunked, mut replayed) = (None, false, false);
        loop {
            line.clear();
            self.read_line(&mut line).await?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            let Some((name, value)) = header.split_once(':') else {
                return Err(format!("not an HTTP header: {header:?}").into());
            };
            let value = value.trim();
            match name.to_ascii_lowercase().as_str() {
                "content-length" => length = Some(value.parse::<usize>()?),
                "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                "idempotent-replayed" | "idempotency-replayed" => replayed = value == "true",
                _ => {}
            }
        }
        self.body.clear();
        if chunked {
            self.read_chunked_body().await?;
        } else {
            self.read_body(length.unwrap_or(0)).await?;
        }
        Ok(Answer { status, replayed })
    }

    /// The body of the last answer.
    pub(crate) fn body(&self) -> &[u8] {
        &self.body
    }

    async fn read_line(&mut self, line: &mut String) -> Res<()> {
        let read = (&mut self.stream)
            .take(MAX_RESPONSE_BYTES as u64)
            .read_line(line)
            .await?;
        if read == 0 {
            return Err("the server closed the connection".into());
        }
        Ok(())
    }

    /// Appends the next `bytes` bytes to the body.
    async fn read_body(&mut self, bytes: usize) -> Res<()> {
        if self.body.len() + bytes > MAX_RESPONSE_BYTES {
            return Err(format!("a {}-byte answer", self.body.len() + bytes).into());
        }
        let start = self.body.len();
        self.body.resize(start + bytes, 0);
        self.stream.read_exact(&mut self.body[start..]).await?;
        Ok(())
    }

    async fn read_chunked_body(&mut self) -> Res<()> {
        let mut line = String::new();
        loop {
            line.clear();
            self.read_line(&mut line).await?;
            let size = line.trim_end().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size.trim(), 16)
                .map_err(|_| format!("not a chunk size: {line:?}"))?;
            // The chunk and its CRLF; the last chunk (0) is followed by an empty trailer line.
            if size == 0 {
                line.clear();
                self.read_line(&mut line).await?;
                return Ok(());
            }
            self.read_body(size + 2).await?;
            // The chunk's CRLF is not the body's.
            self.body.truncate(self.body.len() - 2);
        }
    }
}
