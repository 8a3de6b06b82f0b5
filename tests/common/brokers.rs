//! Brokers of a test's own, for the fault suites (R9–R12): a nats-server or a RabbitMQ node
//! on free ports with a temporary store, which the test can kill and start again on the same
//! port and store; and the relay's sink and the inbox consumer on either, so one suite runs
//! against both.
//!
//! `IDEM_TEST_BROKERS` picks them (`nats,rabbitmq`, or `nats` or `rabbitmq` alone). Unset, the
//! suite is skipped: its private brokers cost the README's test command over two minutes
//! (`.ci/run` and `scripts/flake-hunt` set it).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem::nats::{JetStreamSink, async_nats};
use idem::outbox::{OutboxMessage, Sink, SinkError};
use idem::rabbitmq::AmqpSink;

use super::unique;

/// The stream (NATS) or exchange and queue (RabbitMQ) every fault test publishes to and
/// consumes from, capturing the subjects / routing keys `faults.>` / `faults.#`.
pub const FAULTS: &str = "FAULTS";

/// Which broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    Nats,
    RabbitMq,
}

impl BrokerKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Nats => "nats",
            Self::RabbitMq => "rabbitmq",
        }
    }

    pub fn parse(name: &str) -> Self {
        match name {
            "nats" => Self::Nats,
            "rabbitmq" => Self::RabbitMq,
            other => panic!("unknown broker `{other}` (nats, rabbitmq)"),
        }
    }
}

/// The brokers of this run: `IDEM_TEST_BROKERS`, or none (the suite is skipped, and says so
/// once per process).
pub fn brokers() -> Vec<BrokerKind> {
    let Ok(names) = std::env::var("IDEM_TEST_BROKERS") else {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            eprintln!(
                "the broker fault suite is skipped: IDEM_TEST_BROKERS=nats,rabbitmq runs it \
                 (it starts a nats-server and a RabbitMQ node of its own per test)"
            );
        });
        return Vec::new();
    };
    names
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(BrokerKind::parse)
        .collect()
}

/// Whether this run takes the tests of a broker's own faults on `kind` (their outbox, when
/// they need one, is an SQLite file): not in a run that leaves SQLite out
/// (`IDEM_TEST_SKIP_SQLITE=1`, CI's server steps), which ran them in its SQLite step already.
pub fn broker_only_tests_run(kind: BrokerKind) -> bool {
    brokers().contains(&kind) && super::with_sqlite()
}

pub fn free_port() -> u16 {
    // The kernel may hand the same free port to two of a binary's parallel tests (each closes
    // its probe before its server binds); the loser's server then fails to listen while its
    // readiness probe reaches the winner's. So a port is handed out once per process.
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

fn wait_for_port(port: u16, what: &str) {
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{what} did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A broker server of the test's own.
pub struct Broker {
    kind: BrokerKind,
    port: u16,
    /// RabbitMQ's Erlang distribution port (unused for NATS).
    dist_port: u16,
    store: PathBuf,
    name: String,
    child: Option<Child>,
}

impl Broker {
    pub fn start(kind: BrokerKind) -> Self {
        let name = unique(&format!("idem-{}", kind.name()));
        let store = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&store).expect("store dir");
        if kind == BrokerKind::RabbitMq {
            // The server runs as the `rabbitmq` user.
            let _ = Command::new("chown")
                .args(["rabbitmq:rabbitmq"])
                .arg(&store)
                .status();
        }
        let mut broker = Self {
            kind,
            port: free_port(),
            dist_port: free_port(),
            store,
            name,
            child: None,
        };
        broker.run();
        broker
    }

    pub fn kind(&self) -> BrokerKind {
        self.kind
    }

    pub fn url(&self) -> String {
        match self.kind {
            BrokerKind::Nats => format!("nats://127.0.0.1:{}", self.port),
            BrokerKind::RabbitMq => format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port),
        }
    }

    fn run(&mut self) {
        let child = match self.kind {
            BrokerKind::Nats => Command::new("/usr/sbin/nats-server")
                .args([
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-js",
                    "-sd",
                ])
                .arg(&self.store)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("nats-server (install the nats-server package)"),
            BrokerKind::RabbitMq => Command::new("/usr/sbin/rabbitmq-server")
                .env("RABBITMQ_NODENAME", format!("{}@localhost", self.name))
                .env("RABBITMQ_NODE_PORT", self.port.to_string())
                .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
                .env("RABBITMQ_MNESIA_BASE", self.store.join("mnesia"))
                .env("RABBITMQ_LOG_BASE", self.store.join("log"))
                .env("RABBITMQ_PID_FILE", self.store.join("pid"))
                .env("RABBITMQ_ENABLED_PLUGINS_FILE", self.store.join("plugins"))
                .env("RABBITMQ_CONFIG_FILE", self.store.join("rabbitmq"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("rabbitmq-server (install the rabbitmq-server package)"),
        };
        self.child = Some(child);
        wait_for_port(self.port, self.kind.name());
    }

    /// Kills the server (SIGKILL): nothing it has not written to its store survives.
    pub fn kill(&mut self) {
        if self.kind == BrokerKind::RabbitMq {
            // The Erlang VM runs under `su` as another user: kill it by its pid file.
            if let Ok(pid) = std::fs::read_to_string(self.store.join("pid")) {
                let _ = Command::new("kill")
                    .args(["-9", pid.trim()])
                    .stderr(Stdio::null())
                    .status();
                let _ = std::fs::remove_file(self.store.join("pid"));
            }
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.kind == BrokerKind::RabbitMq {
            // Until its port is free, a new node on it would not start.
            let started = Instant::now();
            while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && started.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Stops the server without closing its connections (SIGSTOP): it takes no more bytes and
    /// answers nothing until [`thaw`](Self::thaw), like a broker that hangs. RabbitMQ only.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen server run again (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        assert_eq!(
            self.kind,
            BrokerKind::RabbitMq,
            "signals go to a RabbitMQ node"
        );
        let pid = std::fs::read_to_string(self.store.join("pid")).expect("the node's pid file");
        let sent = Command::new("kill").args([signal, pid.trim()]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill {signal} {pid}");
    }

    /// Kills the server and starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }

    /// Makes what the fault tests publish to and consume from: a stream capturing
    /// `faults.>`, or a topic exchange and a quorum queue bound to `faults.#`.
    pub async fn prepare(&self) {
        match self.kind {
            BrokerKind::Nats => {
                jetstream(&self.url()).await;
            }
            BrokerKind::RabbitMq => {
                idem::rabbitmq::declare(&self.url(), FAULTS, FAULTS, "faults.#")
                    .await
                    .expect("declare the exchange and queue");
                self.await_queue_membership_on_disk();
            }
        }
    }

    /// Waits until the node has written the quorum queue's Raft membership to disk (its
    /// `names.dets`), so a SIGKILL from now on finds it after the restart.
    ///
    /// RabbitMQ (3.10) confirms a queue's declaration before it writes the queue's
    /// registration with Ra, about a second later here and longer on a loaded machine. A node
    /// killed in between restarts the queue as a new, empty Raft member under another id: it
    /// may never elect itself (every publish then waits for a confirm that never comes: R11's
    /// relay "stalled" with hundreds of messages pending), and if it does, what the broker
    /// had confirmed before the kill is gone (R11's consumer "stalled" with none pending).
    /// Seen on demand by killing a node 300 ms after the declaration: `rabbitmq-queues
    /// quorum_status` then shows a follower at term 0 with an empty log, for minutes. That is
    /// the broker's durability window, not the relay's: tests that kill a node wait it out.
    fn await_queue_membership_on_disk(&self) {
        let started = Instant::now();
        // RABBITMQ_MNESIA_BASE/<node>/quorum/<node>/names.dets, the node being `name@localhost`.
        let node = format!("{}@localhost", self.name);
        let names = self
            .store
            .join("mnesia")
            .join(&node)
            .join("quorum")
            .join(&node)
            .join("names.dets");
        let registered =
            || std::fs::read(&names).is_ok_and(|bytes| contains(&bytes, FAULTS.as_bytes()));
        while !registered() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "RabbitMQ did not write queue {FAULTS}'s Raft membership to disk within 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What a RabbitMQ node says of the fault queue, for a stall's report: its ready and
    /// unacknowledged messages and its consumers (`rabbitmqctl list_queues`, `list_consumers`),
    /// and its Raft member's state (`rabbitmq-queues quorum_status`).
    pub fn describe_queue(&self) -> String {
        if self.kind != BrokerKind::RabbitMq {
            return "(not asked: only a RabbitMQ node is)".to_owned();
        }
        let node = format!("{}@localhost", self.name);
        let ask = |tool: &str, args: &[&str]| {
            // Bounded: a node that hangs must not hang the report.
            let output = Command::new("timeout")
                .arg("30")
                .arg(tool)
                .args(["-n", node.as_str(), "-q"])
                .args(args)
                .output();
            match output {
                Ok(output) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
                Err(e) => format!("{tool}: {e}"),
            }
        };
        format!(
            "{}\n{}\n{}",
            ask(
                "rabbitmqctl",
                &[
                    "list_queues",
                    "name",
                    "messages_ready",
                    "messages_unacknowledged",
                    "consumers",
                ]
            ),
            ask(
                "rabbitmqctl",
                &["list_consumers", "queue_name", "channel_pid", "active"]
            ),
            ask(
                "rabbitmq-queues",
                &["quorum_status", FAULTS, "--formatter", "json"]
            )
        )
    }

    /// The relay's sink on this broker.
    pub async fn sink(&self) -> BrokerSink {
        broker_sink(self.kind, &self.url()).await
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() && self.kind == BrokerKind::RabbitMq {
            // A failed fault test keeps the node's log (the store goes): what the broker did
            // with the queue is the first question about a stall (docs/RELIABILITY.md).
            let kept = std::env::temp_dir().join(format!("idem-broker-log-{}", self.name));
            if std::fs::rename(self.store.join("log"), &kept).is_ok() {
                eprintln!("the RabbitMQ node's log is kept in {}", kept.display());
            }
        }
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A JetStream context on `url` with the [`FAULTS`] stream.
pub async fn jetstream(url: &str) -> async_nats::jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(url)
        .await
        .expect("connect to nats");
    let js = async_nats::jetstream::new(client);
    idem::nats::ensure_stream(&js, FAULTS, &["faults.>"])
        .await
        .expect("stream");
    js
}

/// The relay's sink on the broker of `kind` at `url`.
pub async fn broker_sink(kind: BrokerKind, url: &str) -> BrokerSink {
    match kind {
        BrokerKind::Nats => BrokerSink::Nats(JetStreamSink::new(jetstream(url).await)),
        BrokerKind::RabbitMq => BrokerSink::RabbitMq(AmqpSink::new(url, FAULTS)),
    }
}

/// Either broker's sink.
#[derive(Clone)]
pub enum BrokerSink {
    Nats(JetStreamSink),
    RabbitMq(AmqpSink),
}

impl Sink for BrokerSink {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), SinkError> {
        match self {
            Self::Nats(sink) => sink.publish(message).await,
            Self::RabbitMq(sink) => sink.publish(message).await,
        }
    }

    async fn reconnect(&self) {
        match self {
            Self::Nats(sink) => sink.reconnect().await,
            Self::RabbitMq(sink) => sink.reconnect().await,
        }
    }
}
