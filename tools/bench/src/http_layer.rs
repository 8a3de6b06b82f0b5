//! P11: idem's `IdempotencyLayer` on a trivial axum POST route, beside the same route with no
//! idempotency (bare) and under the peer crate `axum-idempotent` 0.6, all in one process and
//! one server, over HTTP/1.1 keep-alive.
//!
//! The peer keeps responses in a ruts session store; the bench gives it ruts' Redis store at
//! `REDIS_URL` (default `redis://127.0.0.1:6379`), in direct-key mode (`Idempotency-Key`
//! header, required). ruts 0.13 sets every field with `HSET` then `HEXPIRE` in one script;
//! on Redis older than 7.4 the `HEXPIRE` fails after the `HSET` took effect, so the peer's
//! writes report an error (it logs and answers anyway), its entries never expire, and an
//! application cannot create a session (`Session::set` fails). Without a session the peer
//! caches nothing. The bench's clients therefore carry a session id of their own making
//! (`Cookie: session=<22 base64url characters>`, made by `ruts::Id`), one per connection, and
//! the bench deletes those sessions at the end. Without a reachable Redis the peer's figures
//! are `n/a`, with the reason, and the rest is measured.
//!
//! Measured per route, in rounds that alternate the routes (ABC, CBA, ABC): sequential
//! requests on one connection, each a new key followed by the same key again (first and
//! replay p50/p99), then 16 connections sending new keys for a fixed time (requests/s). The
//! figures are the medians of the rounds. Then the guarantees, once: 20 concurrent requests
//! with one key, one key sent again with another body, and for the peer a request without a
//! session and the TTL of its entries.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::serve::ListenerExt;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use fred::prelude::{Builder, ClientLike, Config as RedisConfig, KeysInterface, Pool};
use idem::axum::IdempotencyLayer;
use idem::sea_orm::SeaOrmLeaseStore;
use idem::sqlx::SqlxLeaseStore;
use ruts::store::SessionStore;
use ruts::store::redis::RedisStore;
use ruts::{CookieOptions, Id, SessionLayer};
use sea_orm::DatabaseConnection;
use tower_cookies::CookieManagerLayer;

use crate::harness::{alternate, median, percentile, us};
use crate::http_client::{Answer, Connection, Post};
use crate::setup::{Bench, Plan};
use crate::{BoxError, Res};

/// Where the peer's Redis is when `REDIS_URL` is not set.
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Connections of the peer's Redis pool (as many as the machine has cores, and then some).
const REDIS_POOL: usize = 4;
/// The session cookie's name, as the peer's README configures it.
const SESSION_COOKIE: &str = "session";
/// Requests with one key sent at once by the guarantee probe.
pub(crate) const SAME_KEY_REQUESTS: usize = 20;
/// The peer's description in the report.
pub(crate) const PEER: &str = "axum-idempotent 0.6 (direct-key mode) on ruts 0.13 RedisStore";

/// A route of the bench's server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// The route with no idempotency: the floor.
    Bare,
    /// The route under `idem::axum::IdempotencyLayer` on the run's backend.
    Idem,
    /// The same layer on idem's sqlx store, on the same pool (SeaORM's pool is a sqlx pool).
    IdemSqlx,
    /// The route under `axum_idempotent::IdempotentLayer` (Redis).
    Peer,
}

impl Route {
    pub(crate) const ALL: [Route; 4] = [Route::Bare, Route::Idem, Route::IdemSqlx, Route::Peer];

    fn path(self) -> &'static str {
        match self {
            Self::Bare => "/bare",
            Self::Idem => "/idem",
            Self::IdemSqlx => "/idem-sqlx",
            Self::Peer => "/peer",
        }
    }

    /// The name in the JSON and the table.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Idem => "idem",
            Self::IdemSqlx => "idem_sqlx",
            Self::Peer => "peer",
        }
    }
}

/// How often each route's handler ran: the guarantee probes count executions with it.
#[derive(Debug, Default)]
struct Executions([AtomicU64; 4]);

impl Executions {
    fn of(&self, route: Route) -> u64 {
        self.0[route as usize].load(Ordering::SeqCst)
    }
}

/// The trivial route: counts its execution and answers 201 with a receipt-sized JSON body.
async fn handle(executions: Arc<Executions>, route: Route, body: Bytes) -> impl IntoResponse {
    let n = executions.0[route as usize].fetch_add(1, Ordering::SeqCst);
    let receipt = format!(
        "{{\"payment_id\":{n},\"order_id\":1000,\"amount_cents\":12990,\"currency\":\"EUR\",\
         \"paid_cents\":12990,\"order_version\":1,\"status\":\"paid\",\"request_bytes\":{}}}",
        body.len()
    );
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        receipt,
    )
}

fn route_handler(executions: &Arc<Executions>, route: Route) -> axum::routing::MethodRouter {
    let executions = Arc::clone(executions);
    post(move |body: Bytes| handle(Arc::clone(&executions), route, body))
}

/// The peer's Redis: its pool, the session store the peer's layer reads, and every session
/// id the bench's clients made (deleted at the end).
struct Peer {
    pool: Arc<Pool>,
    store: Arc<RedisStore<Pool>>,
    redis_version: String,
    /// Redis' persistence settings, as the report states them.
    persistence: String,
    sessions: std::sync::Mutex<Vec<Id>>,
}

/// A Redis configuration value (`CONFIG GET name`), or `?`.
async fn redis_config(pool: &Pool, name: &str) -> String {
    let command =
        fred::types::CustomCommand::new("CONFIG", fred::types::ClusterHash::Random, false);
    let reply: Vec<String> = pool
        .custom(command, vec!["GET", name])
        .await
        .unwrap_or_default();
    reply.get(1).cloned().unwrap_or_else(|| "?".to_owned())
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("redis_version", &self.redis_version)
            .finish_non_exhaustive()
    }
}

impl Peer {
    async fn connect() -> Result<Self, String> {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned());
        let config = RedisConfig::from_url(&url).map_err(|e| format!("REDIS_URL {url}: {e}"))?;
        let pool = Builder::from_config(config)
            .with_connection_config(|c| c.connection_timeout = Duration::from_secs(2))
            .build_pool(REDIS_POOL)
            .map_err(|e| format!("Redis pool: {e}"))?;
        match tokio::time::timeout(Duration::from_secs(3), pool.init()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("Redis at {url} not reachable: {e}")),
            Err(_) => return Err(format!("Redis at {url} not reachable within 3 s")),
        }
        let info: String = pool.info(None).await.unwrap_or_default();
        let redis_version = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("unknown")
            .trim()
            .to_owned();
        // Whether Redis keeps the peer's entries across a restart (its durability, against
        // idem's committed ledger).
        let persistence = format!(
            "appendonly {}, save \"{}\"",
            redis_config(&pool, "appendonly").await,
            redis_config(&pool, "save").await
        );
        let pool = Arc::new(pool);
        let store = RedisStore::new(Arc::clone(&pool))
            .await
            .map_err(|e| format!("ruts RedisStore: {e}"))?;
        Ok(Self {
            pool,
            store: Arc::new(store),
            redis_version,
            persistence,
            sessions: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// A new session of the client's own making, as a `Cookie` header value.
    fn new_session(&self) -> (Id, String) {
        let id = Id::default();
        if let Ok(mut sessions) = self.sessions.lock() {
            sessions.push(id.clone());
        }
        let cookie = format!("{SESSION_COOKIE}={id}");
        (id, cookie)
    }

    /// Deletes every session the bench made, and closes the pool.
    async fn clean_up(&self) {
        let sessions = self
            .sessions
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default();
        for id in sessions {
            let _ = self.store.delete(&id).await;
        }
        let _ = self.pool.quit().await;
    }

    /// The peer's router: the trivial route under `IdempotentLayer`, inside ruts'
    /// `SessionLayer` and tower-cookies' `CookieManagerLayer`, in the order its README gives.
    fn router(&self, executions: &Arc<Executions>) -> Router {
        let options = IdempotentOptions::default()
            .use_idempotency_key_header(Some("idempotency-key"), true)
            .expire_after(24 * 60 * 60);
        let sessions = SessionLayer::new(Arc::clone(&self.store))
            .with_cookie_options(CookieOptions::build().name(SESSION_COOKIE));
        Router::new()
            .route(Route::Peer.path(), route_handler(executions, Route::Peer))
            .layer(IdempotentLayer::<RedisStore<Pool>>::new(options))
            .layer(sessions)
            .layer(CookieManagerLayer::new())
    }
}

/// One client: a connection and, for the peer, its session cookie.
struct Client {
    connection: Connection,
    cookie: Option<String>,
}

/// The server and what its clients need.
struct Server {
    addr: SocketAddr,
    executions: Arc<Executions>,
    peer: Option<Peer>,
    body: Vec<u8>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn client(&self, route: Route) -> Res<Client> {
        let cookie = match (route, &self.peer) {
            (Route::Peer, Some(peer)) => Some(peer.new_session().1),
            _ => None,
        };
        Ok(Client {
            connection: Connection::open(self.addr).await?,
            cookie,
        })
    }

    fn routes(&self) -> Vec<Route> {
        Route::ALL
            .into_iter()
            .filter(|&r| r != Route::Peer || self.peer.is_some())
            .collect()
    }
}

impl Client {
    async fn send(&mut self, route: Route, key: &str, body: &[u8]) -> Res<Answer> {
        let post = Post {
            path: route.path(),
            key: Some(key),
            cookie: self.cookie.as_deref(),
            body,
        };
        self.connection.post(post).await
    }
}

/// One route's figures, one value per round.
#[derive(Debug, Default)]
pub(crate) struct RouteFigures {
    pub(crate) first_p50_us: Vec<f64>,
    pub(crate) first_p99_us: Vec<f64>,
    pub(crate) replay_p50_us: Vec<f64>,
    pub(crate) replay_p99_us: Vec<f64>,
    pub(crate) requests_per_s: Vec<f64>,
    /// Replays answered without the route's replay header (for bare: every one).
    pub(crate) replays_not_marked: u64,
    pub(crate) replays: u64,
}

impl RouteFigures {
    pub(crate) fn first_p50(&self) -> f64 {
        median(&self.first_p50_us)
    }
    pub(crate) fn first_p99(&self) -> f64 {
        median(&self.first_p99_us)
    }
    pub(crate) fn replay_p50(&self) -> f64 {
        median(&self.replay_p50_us)
    }
    pub(crate) fn replay_p99(&self) -> f64 {
        median(&self.replay_p99_us)
    }
    pub(crate) fn rps(&self) -> f64 {
        median(&self.requests_per_s)
    }
}

/// What one probe of a route's guarantees saw.
#[derive(Debug, Default, Clone)]
pub(crate) struct Probe {
    /// Times the handler ran during the probe.
    pub(crate) executions: u64,
    /// The answers' statuses, with how many of each, in ascending order.
    pub(crate) statuses: Vec<(u16, usize)>,
}

impl Probe {
    fn of(executions: u64, answers: &[Answer]) -> Self {
        let mut statuses: Vec<(u16, usize)> = Vec::new();
        let mut codes: Vec<u16> = answers.iter().map(|a| a.status).collect();
        codes.sort_unstable();
        for code in codes {
            match statuses.last_mut() {
                Some((c, n)) if *c == code => *n += 1,
                _ => statuses.push((code, 1)),
            }
        }
        Self {
            executions,
            statuses,
        }
    }

    pub(crate) fn statuses_text(&self) -> String {
        self.statuses
            .iter()
            .map(|(code, n)| format!("{n}x{code}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The guarantees, probed once per route.
#[derive(Debug, Default)]
pub(crate) struct Guarantees {
    /// [`SAME_KEY_REQUESTS`] requests with one new key, sent at once.
    pub(crate) same_key_at_once: Vec<(Route, Probe)>,
    /// A key sent again with another body, after its first answer.
    pub(crate) key_reused_with_other_body: Vec<(Route, Probe)>,
    /// The peer: one key sent twice without a session cookie (executions of 2).
    pub(crate) peer_without_session: Option<Probe>,
    /// The peer: the TTL Redis reports for a session holding an entry (`-1`: none).
    pub(crate) peer_entry_ttl_s: Option<i64>,
}

/// P11's figures.
#[derive(Debug)]
pub(crate) struct HttpFigures {
    pub(crate) keys_per_round: usize,
    pub(crate) rounds: usize,
    pub(crate) clients: usize,
    pub(crate) seconds: f64,
    pub(crate) request_bytes: usize,
    /// Per route; the peer's is `None` when it was not measured.
    pub(crate) routes: [Option<RouteFigures>; 4],
    /// The peer's setup, or why it was not measured.
    pub(crate) peer: Result<String, String>,
    pub(crate) guarantees: Guarantees,
    /// p50 of a durable commit in each round: a one-row `INSERT` auto-committed on the
    /// bench's pool, the floor of each commit a first request through idem's layer makes.
    pub(crate) commit_p50_us: Vec<f64>,
}

impl HttpFigures {
    pub(crate) fn route(&self, route: Route) -> Option<&RouteFigures> {
        self.routes[route as usize].as_ref()
    }

    /// `idem`'s figure (a route of idem's layer) over the peer's, where both were measured.
    fn vs_peer(&self, idem: Route, figure: impl Fn(&RouteFigures) -> f64) -> Option<f64> {
        Some(figure(self.route(idem)?) / figure(self.route(Route::Peer)?))
    }

    /// The replay p50 of idem's layer on `idem`'s store over the peer's (goal ≤ 1).
    pub(crate) fn replay_p50_vs_peer(&self, idem: Route) -> Option<f64> {
        self.vs_peer(idem, RouteFigures::replay_p50)
    }

    /// The first-request p50 of idem's layer on `idem`'s store over the peer's (goal ≤ 2 on
    /// SQLite).
    pub(crate) fn first_p50_vs_peer(&self, idem: Route) -> Option<f64> {
        self.vs_peer(idem, RouteFigures::first_p50)
    }

    /// The requests/s of idem's layer on `idem`'s store over the peer's at 16 clients (goal ≥
    /// 0.33 on SQLite and PostgreSQL).
    pub(crate) fn rps_vs_peer(&self, idem: Route) -> Option<f64> {
        self.vs_peer(idem, RouteFigures::rps)
    }
}

/// Sequential requests on one connection: `keys` new keys, each sent twice (first, replay).
async fn sequential(
    b: &Bench,
    server: &Server,
    client: &mut Client,
    route: Route,
    keys: usize,
    into: Option<&mut RouteFigures>,
) -> Res<()> {
    let (mut first, mut replay) = (Vec::with_capacity(keys), Vec::with_capacity(keys));
    let mut not_marked = 0;

    for _ in 0..keys {
        let key = b.new_key();
        let start = Instant::now();
        let answer = client.send(route, &key, &server.body).await?;
        first.push(us(start.elapsed()));
        expect_created(route, answer)?;
        let start = Instant::now();
        let answer = client.send(route, &key, &server.body).await?;
        replay.push(us(start.elapsed()));
        expect_created(route, answer)?;
        not_marked += u64::from(!answer.replayed);
    }
    if let Some(figures) = into {
        figures.first_p50_us.push(percentile(&first, 0.5));
        figures.first_p99_us.push(percentile(&first, 0.99));
        figures.replay_p50_us.push(percentile(&replay, 0.5));
        figures.replay_p99_us.push(percentile(&replay, 0.99));
        figures.replays += keys as u64;
        figures.replays_not_marked += not_marked;
    }
    Ok(())
}

fn expect_created(route: Route, answer: Answer) -> Res<()> {
    if answer.status != 201 {
        return Err(format!("{} answered {}", route.path(), answer.status).into());
    }
    Ok(())
}

/// `clients` connections sending new keys until `length` is over: requests per second.
async fn concurrent(
    b: &Arc<Bench>,
    server: &Server,
    route: Route,
    clients: usize,
    length: Duration,
) -> Res<f64> {
    let mut connected = Vec::with_capacity(clients);
    for _ in 0..clients {
        connected.push(server.client(route).await?);
    }
    let body = Arc::new(server.body.clone());
    let start = Instant::now();
    let deadline = start + length;
    let mut set = tokio::task::JoinSet::new();
    for mut client in connected {
        let (b, body) = (Arc::clone(b), Arc::clone(&body));
        set.spawn(async move {
            let mut done = 0_u64;
            while Instant::now() < deadline {
                let answer = client.send(route, &b.new_key(), &body).await?;
                expect_created(route, answer)?;
                done += 1;
            }
            Ok::<u64, BoxError>(done)
        });
    }
    let mut total = 0;
    for done in set.join_all().await {
        total += done?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// [`SAME_KEY_REQUESTS`] requests with one new key, released at once from connections
/// opened beforehand (for the peer, all in one session, where its entries live).
async fn same_key_at_once(b: &Bench, server: &Server, route: Route) -> Res<Probe> {
    let key = b.new_key();
    let cookie = match (route, &server.peer) {
        (Route::Peer, Some(peer)) => Some(peer.new_session().1),
        _ => None,
    };
    let mut clients = Vec::with_capacity(SAME_KEY_REQUESTS);
    for _ in 0..SAME_KEY_REQUESTS {
        clients.push(Client {
            connection: Connection::open(server.addr).await?,
            cookie: cookie.clone(),
        });
    }
    let before = server.executions.of(route);
    let gate = Arc::new(tokio::sync::Barrier::new(SAME_KEY_REQUESTS));
    let body = Arc::new(server.body.clone());
    let mut set = tokio::task::JoinSet::new();
    for mut client in clients {
        let (gate, key, body) = (Arc::clone(&gate), key.clone(), Arc::clone(&body));
        set.spawn(async move {
            gate.wait().await;
            client.send(route, &key, &body).await
        });
    }
    let answers = set
        .join_all()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    // Let a route that runs on a task of its own (idem's) finish before counting.
    tokio::time::sleep(Duration::from_millis(50)).await;
    Ok(Probe::of(server.executions.of(route) - before, &answers))
}

/// A key's first request, then the same key with another body.
async fn key_reused(b: &Bench, server: &Server, route: Route) -> Res<Probe> {
    let mut client = server.client(route).await?;
    let key = b.new_key();
    let before = server.executions.of(route);
    let first = client.send(route, &key, &server.body).await?;
    let mut other = server.body.clone();
    other.extend_from_slice(b" ");
    let second = client.send(route, &key, &other).await?;
    Ok(Probe::of(
        server.executions.of(route) - before,
        &[first, second],
    ))
}

async fn guarantees(b: &Bench, server: &Server) -> Res<Guarantees> {
    let mut out = Guarantees::default();
    for route in server.routes() {
        out.same_key_at_once
            .push((route, same_key_at_once(b, server, route).await?));
        out.key_reused_with_other_body
            .push((route, key_reused(b, server, route).await?));
    }
    if let Some(peer) = &server.peer {
        let mut client = Client {
            connection: Connection::open(server.addr).await?,
            cookie: None,
        };
        let key = b.new_key();
        let before = server.executions.of(Route::Peer);
        let first = client.send(Route::Peer, &key, &server.body).await?;
        let again = client.send(Route::Peer, &key, &server.body).await?;
        out.peer_without_session = Some(Probe::of(
            server.executions.of(Route::Peer) - before,
            &[first, again],
        ));
        let (id, cookie) = peer.new_session();
        let mut client = Client {
            connection: Connection::open(server.addr).await?,
            cookie: Some(cookie),
        };
        client.send(Route::Peer, &b.new_key(), &server.body).await?;
        out.peer_entry_ttl_s = peer.pool.ttl::<i64, _>(&id).await.ok();
    }
    Ok(out)
}

/// P11: the routes' latency and throughput in alternating rounds, then their guarantees.
pub(crate) async fn measure(b: &Arc<Bench>, plan: &Plan) -> Res<HttpFigures> {
    let peer = Peer::connect().await;
    let peer_setup = match &peer {
        Ok(p) => Ok(format!(
            "{PEER}, Redis {} ({}) at {}, fred pool of {REDIS_POOL}; clients send a session id \
             of their own making (Cookie: {SESSION_COOKIE}=<ruts::Id>), one per connection",
            p.redis_version,
            p.persistence,
            std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned())
        )),
        Err(reason) => Err(reason.clone()),
    };
    let executions = Arc::new(Executions::default());
    let layer = IdempotencyLayer::new(SeaOrmLeaseStore::new(b.db.clone()), "bench.p11");
    let mut app = Router::new()
        .route(Route::Bare.path(), route_handler(&executions, Route::Bare))
        .route(
            Route::Idem.path(),
            route_handler(&executions, Route::Idem).route_layer(layer),
        )
        .route(
            Route::IdemSqlx.path(),
            route_handler(&executions, Route::IdemSqlx).route_layer(sqlx_layer(&b.db)),
        );
    if let Ok(peer) = &peer {
        app = app.merge(peer.router(&executions));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let server = Server {
        addr,
        executions,
        peer: peer.ok(),
        body: serde_json::to_vec(&b.template)?,
        task,
    };
    let measured = rounds(b, plan, &server).await;
    let guarantees = match &measured {
        Ok(_) => guarantees(b, &server).await,
        Err(_) => Ok(Guarantees::default()),
    };
    if let Some(peer) = &server.peer {
        peer.clean_up().await;
    }
    server.task.abort();
    let (routes, commit_p50_us) = measured?;
    Ok(HttpFigures {
        commit_p50_us,
        keys_per_round: plan.http_keys,
        rounds: plan.http_rounds,
        clients: plan.clients,
        seconds: plan.http_round.as_secs_f64(),
        request_bytes: server.body.len(),
        routes,
        peer: peer_setup,
        guarantees: guarantees?,
    })
}

/// idem's layer on its sqlx store, on the pool under `db` (the same connections as the SeaORM
/// route's), in a scope of its own.
fn sqlx_layer(db: &DatabaseConnection) -> IdempotencyLayer {
    use sea_orm::DatabaseConnectionType as Kind;
    const SCOPE: &str = "bench.p11.sqlx";
    match &db.inner {
        Kind::SqlxSqlitePoolConnection(_) => IdempotencyLayer::new(
            SqlxLeaseStore::new(db.get_sqlite_connection_pool().clone()),
            SCOPE,
        ),
        Kind::SqlxPostgresPoolConnection(_) => IdempotencyLayer::new(
            SqlxLeaseStore::new(db.get_postgres_connection_pool().clone()),
            SCOPE,
        ),
        _ => IdempotencyLayer::new(
            SqlxLeaseStore::new(db.get_mysql_connection_pool().clone()),
            SCOPE,
        ),
    }
}

/// Warm-up, then the alternating rounds.
/// The routes' figures, and the durable commit's p50 of each round.
type Rounds = ([Option<RouteFigures>; 4], Vec<f64>);

async fn rounds(b: &Arc<Bench>, plan: &Plan, server: &Server) -> Res<Rounds> {
    let routes = server.routes();
    let mut sequential_clients = Vec::new();
    for &route in &routes {
        let mut client = server.client(route).await?;
        sequential(b, server, &mut client, route, 100, None).await?;
        concurrent(b, server, route, plan.clients, Duration::from_millis(300)).await?;
        sequential_clients.push(client);
    }
    let mut out: [Option<RouteFigures>; 4] = Default::default();
    for &route in &routes {
        out[route as usize] = Some(RouteFigures::default());
    }
    let order: Vec<usize> = (0..routes.len()).collect();
    let mut commits = Vec::with_capacity(plan.http_rounds);
    for round in 0..plan.http_rounds {
        for i in alternate(&order, round) {
            let route = routes[i];
            let mut figures = out[route as usize].take().unwrap_or_default();
            let client = &mut sequential_clients[i];
            sequential(b, server, client, route, plan.http_keys, Some(&mut figures)).await?;
            let rps = concurrent(b, server, route, plan.clients, plan.http_round).await?;
            figures.requests_per_s.push(rps);
            out[route as usize] = Some(figures);
        }
        commits.push(commit_p50(b).await?);
        b.progress(&format!("p11: round {}/{}", round + 1, plan.http_rounds));
    }
    Ok((out, commits))
}

/// One-row `INSERT`s auto-committed on the bench's pool, one at a time: their p50 in µs.
async fn commit_p50(b: &Bench) -> Res<f64> {
    const PROBES: usize = 200;
    let mut took = Vec::with_capacity(PROBES);
    for _ in 0..PROBES {
        let start = Instant::now();
        crate::lease::insert_row(&b.db, "p11-commit-probe").await?;
        took.push(us(start.elapsed()));
    }
    Ok(percentile(&took, 0.5))
}
