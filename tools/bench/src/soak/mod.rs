//! The soak (R22 in docs/RELIABILITY.md): does a service on idem hold steady for as long as it
//! runs? The payments example on the backend asked for, with the gateway example (on its own
//! SQLite file) as its payment provider, both built in release; `--clients` clients (default
//! 8) for `--soak` minutes, each creating an order and paying it (lease mode: the charge is a
//! recorded step, the completer runs), one request in four a retry of the request before it
//! (same key, same body: a replay).
//!
//! ```text
//! cargo run --release -p idem-bench -- --soak 30 --backend postgres [--url URL] [--clients 8] [--window 300] [--ttl SECS]
//! ```
//!
//! The service purges as a service should (every 10 s: records past their TTL, messages
//! published longer ago); `--ttl` shortens the TTL from a day to seconds, so the purge
//! deletes as fast as calls arrive and the ledger's size should level off. On a PostgreSQL
//! server whose autovacuum is off (this project's CI machines), the soak vacuums and analyzes
//! the tables autovacuum's rules name, every minute, as autovacuum would; `--no-vacuum` leaves
//! the server as it is.
//!
//! Every window (default 5 minutes) prints the calls answered, calls per second, create and
//! pay p50 and p99, errors, the payments process's resident memory, and the rows of its
//! ledger and outbox; the end prints the ratios R22 bounds (last window's throughput against
//! the first's, pay p99 of the last window against the second's, RSS at the end against the
//! end of the first window). Under each window's line, what the database server spent: the
//! statements that took the most time and the tables scanned whole ([`server_stats`]). The
//! service's database is made afresh: `idem_soak` on the
//! server (dropped and created), or an SQLite file in the temp directory.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sea_orm::{ConnectionTrait, Database, DatabaseConnection, Statement, TryGetable};

use crate::Res;
use crate::harness::percentile;
use crate::http_client::{Connection, Post};
use crate::setup::Backend;

mod server_stats;

/// What `--soak` runs.
#[derive(Debug, Clone)]
pub(crate) struct Soak {
    pub(crate) duration: Duration,
    pub(crate) clients: usize,
    pub(crate) window: Duration,
    /// The records' TTL (`RECORD_TTL_SECS`), when not the service's default.
    pub(crate) ttl: Option<Duration>,
    /// `--no-vacuum`: leave a PostgreSQL server whose autovacuum is off as it is.
    pub(crate) no_vacuum: bool,
}

/// The payments example's TTL, a day (its `RECORD_TTL_SECS` unset).
const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

/// The database the soak's service uses, made afresh.
const SOAK_DATABASE: &str = "idem_soak";

/// One window's answers, as the clients report them.
#[derive(Debug, Default)]
struct Window {
    create_ms: Vec<f64>,
    pay_ms: Vec<f64>,
    errors: u64,
    first_error: Option<String>,
}

/// One window's figures, as printed.
#[derive(Debug, Clone, Copy)]
struct Figures {
    calls_per_s: f64,
    /// The window's [`Calibration`], in ms.
    calibration_ms: f64,
    pay_p99_ms: f64,
    rss_mb: f64,
}

/// A child process killed when dropped (the soak's services end with it, also on an error).
struct Service {
    name: &'static str,
    child: Child,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) async fn run(backend: Backend, url: Option<&str>, soak: &Soak) -> Res<()> {
    let (payments_bin, gateway_bin) = build_examples()?;
    let database_url = fresh_database(backend, url).await?;
    let gateway_db =
        std::env::temp_dir().join(format!("idem-soak-gateway-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&gateway_db);
    let logs = std::env::temp_dir().join("idem-soak-logs");
    std::fs::create_dir_all(&logs)?;

    let gateway_addr = free_addr()?;
    let mut gateway = start(
        "gateway",
        &gateway_bin,
        gateway_addr,
        &[(
            "DATABASE_URL",
            format!("sqlite://{}?mode=rwc", gateway_db.display()),
        )],
        &logs,
    )?;
    await_healthy(gateway_addr, "/charges", "gateway").await?;
    let payments_addr = free_addr()?;
    let mut payments = start(
        "payments",
        &payments_bin,
        payments_addr,
        &[
            ("DATABASE_URL", database_url.clone()),
            ("GATEWAY_URL", format!("http://{gateway_addr}")),
            (
                "RECORD_TTL_SECS",
                soak.ttl.unwrap_or(DEFAULT_TTL).as_secs().to_string(),
            ),
        ],
        &logs,
    )?;
    await_healthy(payments_addr, "/healthz", "payments").await?;
    let db = Database::connect(&database_url).await?;
    let mut server_stats = server_stats::ServerStats::start(&db).await;
    let vacuum = stand_in_for_autovacuum(backend, &database_url, soak).await?;

    println!(
        "soak: payments on {} ({}), gateway on SQLite, {} clients, {:.0} min, windows of {} s, \
         records kept {} s; logs in {}",
        backend.name(),
        database_url.split('?').next().unwrap_or_default(),
        soak.clients,
        soak.duration.as_secs_f64() / 60.0,
        soak.window.as_secs(),
        soak.ttl.unwrap_or(DEFAULT_TTL).as_secs(),
        logs.display()
    );
    println!(
        "{:>6} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>7} {:>9} {:>9}",
        "min",
        "calls",
        "calls/s",
        "create50",
        "create99",
        "pay50",
        "pay99",
        "errors",
        "rss MB",
        "ledger",
        "outbox"
    );

    let window = Arc::new(Mutex::new(Window::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..soak.clients {
        let (window, stop) = (window.clone(), stop.clone());
        clients.spawn(async move { drive(client, payments_addr, &window, &stop).await });
    }

    let gateway_store = Database::connect(format!("sqlite://{}", gateway_db.display())).await?;
    let mut cpu = Cpu::read(&payments, &gateway);
    let machine = Calibration::start();
    let started = Instant::now();
    let mut figures: Vec<Figures> = Vec::new();
    let mut total_errors = 0;
    while started.elapsed() < soak.duration {
        let left = soak.duration.saturating_sub(started.elapsed());
        let window_started = Instant::now();
        tokio::time::sleep(soak.window.min(left)).await;
        let took = window_started.elapsed().as_secs_f64();
        let done = std::mem::take(&mut *window.lock().unwrap_or_else(|e| e.into_inner()));
        let calls = done.create_ms.len() + done.pay_ms.len();
        let rss_mb = rss_mb(payments.child.id())?;
        let (ledger, outbox) = (
            rows(&db, "idem_ledger").await?,
            rows(&db, "idem_outbox").await?,
        );
        total_errors += done.errors;
        println!(
            "{:>6.1} {:>8} {:>8.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6} {:>7.1} {:>9} {:>9}",
            started.elapsed().as_secs_f64() / 60.0,
            calls,
            calls as f64 / took,
            percentile(&done.create_ms, 0.5),
            percentile(&done.create_ms, 0.99),
            percentile(&done.pay_ms, 0.5),
            percentile(&done.pay_ms, 0.99),
            done.errors,
            rss_mb,
            ledger,
            outbox
        );
        if let Some(error) = &done.first_error {
            println!("       first error of the window: {error}");
        }
        // Where the processes' time goes: CPU per call answered, for each process on the
        // machine that serves a call (a slope that is not the database's statements shows
        // here), and the size of the gateway's own SQLite ledger.
        let now = Cpu::read(&payments, &gateway);
        let per_call = |after: f64, before: f64| (after - before) * 1000.0 / calls.max(1) as f64;
        println!(
            "       cpu ms per call: payments {:.3}, gateway {:.3}, postgres and mysqld {:.3}; \
             gateway ledger {} rows, {:.1} MB on disk",
            per_call(now.payments, cpu.payments),
            per_call(now.gateway, cpu.gateway),
            per_call(now.servers_since(&cpu), 0.0),
            rows(&gateway_store, "idem_ledger").await?,
            file_mb(&gateway_db)
        );
        cpu = now;
        let calibration = machine.window_ms();
        println!(
            "       machine: SHA-256 of 16 MiB took {calibration:.1} ms of CPU, the window's median \
             (first window {:.1})",
            figures.first().map_or(calibration, |f| f.calibration_ms)
        );
        if let Some(stats) = &mut server_stats {
            match stats.window(&db).await {
                Ok(lines) => lines.iter().for_each(|line| println!("{line}")),
                Err(e) => println!("       no server statistics for this window: {e}"),
            }
        }
        figures.push(Figures {
            calls_per_s: calls as f64 / took,
            pay_p99_ms: percentile(&done.pay_ms, 0.99),
            rss_mb,
            calibration_ms: calibration,
        });
        if exited(&mut payments) || exited(&mut gateway) {
            return Err("a service of the soak exited (see its log)".into());
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(vacuum) = vacuum {
        vacuum.abort();
    }
    while let Some(client) = clients.join_next().await {
        client??;
    }
    summarize(&figures, total_errors);
    drop((payments, gateway, gateway_store));
    for file in ["db", "db-wal", "db-shm"] {
        let _ = std::fs::remove_file(gateway_db.with_extension(file));
    }
    Ok(())
}

/// How often autovacuum looks at a database by default (`autovacuum_naptime`).
const AUTOVACUUM_NAPTIME: Duration = Duration::from_secs(60);

/// The tables of the soak's database that autovacuum would vacuum or analyze now, by its own
/// rules and the server's settings for them (PostgreSQL 13+): vacuum when the dead rows pass
/// `autovacuum_vacuum_threshold + autovacuum_vacuum_scale_factor × rows`, or the rows inserted
/// since the last vacuum pass the insert threshold and scale factor (`-1` turns that rule off);
/// analyze when the rows changed since the last analyze pass the analyze threshold and scale
/// factor.
const AUTOVACUUM_DUE: &str = "\
    WITH setting AS (SELECT \
      current_setting('autovacuum_vacuum_threshold')::float8 AS vacuum_base, \
      current_setting('autovacuum_vacuum_scale_factor')::float8 AS vacuum_scale, \
      current_setting('autovacuum_vacuum_insert_threshold')::float8 AS insert_base, \
      current_setting('autovacuum_vacuum_insert_scale_factor')::float8 AS insert_scale, \
      current_setting('autovacuum_analyze_threshold')::float8 AS analyze_base, \
      current_setting('autovacuum_analyze_scale_factor')::float8 AS analyze_scale), \
    due AS (SELECT quote_ident(t.schemaname) || '.' || quote_ident(t.relname) AS name, \
      t.n_dead_tup > s.vacuum_base + s.vacuum_scale * GREATEST(c.reltuples, 0) \
        OR (s.insert_base >= 0 AND t.n_ins_since_vacuum > s.insert_base + s.insert_scale * GREATEST(c.reltuples, 0)) AS due_vacuum, \
      t.n_mod_since_analyze > s.analyze_base + s.analyze_scale * GREATEST(c.reltuples, 0) AS due_analyze \
      FROM pg_stat_user_tables t JOIN pg_class c ON c.oid = t.relid CROSS JOIN setting s) \
    SELECT name, due_vacuum, due_analyze FROM due WHERE due_vacuum OR due_analyze ORDER BY name";

/// On a PostgreSQL server whose autovacuum is off (this project's CI machines turn it off), a
/// task that does what autovacuum would: every minute, it vacuums and analyzes the tables of
/// the soak's database that autovacuum's rules name ([`AUTOVACUUM_DUE`]), throttled as
/// autovacuum is (`autovacuum_vacuum_cost_delay` and `_limit`). Without it, tables whose rows
/// are deleted as fast as they are written (the steps and stored calls of lease mode) grow
/// without end, and a soak measures that instead of the service (R22: a run without it lost
/// 13 % in 10 minutes, and one `VACUUM ANALYZE` brought the first window's throughput back).
/// Not the whole database every minute: that costs in proportion to the tables, which grow
/// all along, while autovacuum's rules space its runs as a table grows (a 30-minute run that
/// vacuumed everything every minute spent 2.3 s, then 2.45 s, a minute on it). `--no-vacuum`
/// runs the server as it is.
async fn stand_in_for_autovacuum(
    backend: Backend,
    database_url: &str,
    soak: &Soak,
) -> Res<Option<tokio::task::JoinHandle<()>>> {
    if backend != Backend::Postgres || soak.no_vacuum {
        return Ok(None);
    }
    // One connection, so the session's throttle below holds for every VACUUM.
    let mut options = sea_orm::ConnectOptions::new(database_url);
    options.max_connections(1).min_connections(1);
    let db = Database::connect(options).await?;
    if scalar::<String>(&db, "SELECT current_setting('autovacuum')").await? == "on" {
        return Ok(None);
    }
    db.execute_unprepared(
        "SELECT set_config('vacuum_cost_delay', current_setting('autovacuum_vacuum_cost_delay'), false), \
         set_config('vacuum_cost_limit', CASE current_setting('autovacuum_vacuum_cost_limit') \
           WHEN '-1' THEN current_setting('vacuum_cost_limit') \
           ELSE current_setting('autovacuum_vacuum_cost_limit') END, false)",
    )
    .await?;
    println!(
        "soak: autovacuum is off, so every {} s the soak vacuums and analyzes the tables of \
         {SOAK_DATABASE} that autovacuum's rules name, throttled as autovacuum is (--no-vacuum: \
         leave it off)",
        AUTOVACUUM_NAPTIME.as_secs()
    );
    Ok(Some(tokio::spawn(async move {
        let mut every = tokio::time::interval(AUTOVACUUM_NAPTIME);
        every.tick().await;
        loop {
            every.tick().await;
            if let Err(e) = vacuum_what_is_due(&db).await {
                println!("       the soak's VACUUM failed: {e}");
            }
        }
    })))
}

/// One round of [`stand_in_for_autovacuum`].
async fn vacuum_what_is_due(db: &DatabaseConnection) -> Res<()> {
    let due = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            AUTOVACUUM_DUE,
        ))
        .await?;
    for row in due {
        let name: String = row.try_get_by_index(0)?;
        let (vacuum, analyze): (bool, bool) = (row.try_get_by_index(1)?, row.try_get_by_index(2)?);
        let sql = match (vacuum, analyze) {
            (true, true) => format!("VACUUM (ANALYZE) {name}"),
            (true, false) => format!("VACUUM {name}"),
            _ => format!("ANALYZE {name}"),
        };
        db.execute_unprepared(&sql).await?;
    }
    Ok(())
}

/// R22's ratios: what the issue bounds, printed, not asserted (a soak is read).
fn summarize(figures: &[Figures], errors: u64) {
    let (Some(first), Some(last)) = (figures.first(), figures.last()) else {
        return;
    };
    println!(
        "throughput, last window / first: {:.2} (R22: >= 0.90); at the machine's speed of the \
         first window: {:.2}",
        last.calls_per_s / first.calls_per_s,
        last.calls_per_s * last.calibration_ms / (first.calls_per_s * first.calibration_ms)
    );
    if let Some(second) = figures.get(1) {
        println!(
            "pay p99, last window / second: {:.2} (R22: <= 1.2)",
            last.pay_p99_ms / second.pay_p99_ms
        );
    }
    println!(
        "RSS, end / end of the first window: {:.2} (R22: <= 1.10)",
        last.rss_mb / first.rss_mb
    );
    println!("errors: {errors} (R22: 0)");
}

/// Whether `service`'s process has ended.
fn exited(service: &mut Service) -> bool {
    let ended = !matches!(service.child.try_wait(), Ok(None));
    if ended {
        eprintln!("soak: the {} example exited", service.name);
    }
    ended
}

/// One client: create an order, pay it, and every third order retry the create or the pay
/// (orders 0, 3, … the create; 1, 4, … the pay): 2 retries in 8 requests.
async fn drive(
    client: usize,
    addr: SocketAddr,
    window: &Mutex<Window>,
    stop: &AtomicBool,
) -> Res<()> {
    let mut connection = Connection::open(addr).await?;
    let mut order = 0_u64;
    while !stop.load(Ordering::Relaxed) {
        let create_key = format!("soak-{}-{client}-{order}-create", std::process::id());
        let create_body = format!(
            r#"{{"customer":"soak-{client}","amount_cents":{},"currency":"EUR"}}"#,
            1_000 + order % 100
        );
        let create = Post {
            path: "/orders",
            key: Some(&create_key),
            cookie: None,
            body: create_body.as_bytes(),
        };
        let Some(id) = send(&mut connection, create, 201, Kind::Create, window).await? else {
            order += 1;
            continue;
        };
        if order.is_multiple_of(3) {
            send(&mut connection, create, 201, Kind::Create, window).await?;
        }
        let pay_key = format!("soak-{}-{client}-{order}-pay", std::process::id());
        let pay_body = format!(r#"{{"amount_cents":{}}}"#, 1_000 + order % 100);
        let path = format!("/orders/{id}/pay");
        let pay = Post {
            path: &path,
            key: Some(&pay_key),
            cookie: None,
            body: pay_body.as_bytes(),
        };
        send(&mut connection, pay, 200, Kind::Pay, window).await?;
        if order % 3 == 1 {
            send(&mut connection, pay, 200, Kind::Pay, window).await?;
        }
        order += 1;
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Create,
    Pay,
}

/// Sends `post`, counts its time in the window (or an error, if the status is not
/// `expected`), and returns the answer's `id` field, if it has one.
async fn send(
    connection: &mut Connection,
    post: Post<'_>,
    expected: u16,
    kind: Kind,
    window: &Mutex<Window>,
) -> Res<Option<String>> {
    let sent = Instant::now();
    let answer = connection.post(post).await?;
    let ms = sent.elapsed().as_secs_f64() * 1e3;
    let body = connection.body();
    let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
    if answer.status != expected {
        window.errors += 1;
        window.first_error.get_or_insert_with(|| {
            format!(
                "{} answered {}: {}",
                post.path,
                answer.status,
                String::from_utf8_lossy(body)
            )
        });
        return Ok(None);
    }
    match kind {
        Kind::Create => window.create_ms.push(ms),
        Kind::Pay => window.pay_ms.push(ms),
    }
    let id = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("id").and_then(|id| id.as_str().map(str::to_owned)));
    Ok(id)
}

/// Builds the payments and gateway examples in release and returns their executables.
fn build_examples() -> Res<(PathBuf, PathBuf)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--example",
            "payments",
            "--example",
            "gateway",
            "--message-format",
            "json",
        ])
        .stderr(Stdio::inherit())
        .output()?;
    if !output.status.success() {
        return Err("building the payments and gateway examples failed".into());
    }
    let (mut payments, mut gateway) = (None, None);
    for line in output.stdout.split(|&b| b == b'\n') {
        let Ok(message) = serde_json::from_slice::<serde_json::Value>(line) else {
            continue;
        };
        let name = message["target"]["name"].as_str().unwrap_or_default();
        if let Some(executable) = message["executable"].as_str() {
            match name {
                "payments" => payments = Some(PathBuf::from(executable)),
                "gateway" => gateway = Some(PathBuf::from(executable)),
                _ => {}
            }
        }
    }
    Ok((
        payments.ok_or("cargo named no payments executable")?,
        gateway.ok_or("cargo named no gateway executable")?,
    ))
}

/// The soak's database, dropped and created again on a server; a new SQLite file otherwise.
async fn fresh_database(backend: Backend, url: Option<&str>) -> Res<String> {
    match backend {
        Backend::Sqlite => {
            let path = std::env::temp_dir().join(format!("{SOAK_DATABASE}.db"));
            crate::setup::remove_sqlite(&path);
            Ok(format!("sqlite://{}?mode=rwc", path.display()))
        }
        Backend::Postgres | Backend::Mysql => {
            let server = url.unwrap_or(match backend {
                Backend::Postgres => "postgres://postgres@127.0.0.1:5432/postgres",
                _ => "mysql://root@127.0.0.1:3306/mysql",
            });
            let admin = Database::connect(server).await?;
            admin
                .execute_unprepared(&match backend {
                    Backend::Postgres => {
                        format!("DROP DATABASE IF EXISTS {SOAK_DATABASE} WITH (FORCE)")
                    }
                    _ => format!("DROP DATABASE IF EXISTS {SOAK_DATABASE}"),
                })
                .await?;
            admin
                .execute_unprepared(&format!("CREATE DATABASE {SOAK_DATABASE}"))
                .await?;
            let (base, _) = server
                .rsplit_once('/')
                .ok_or("a server URL ends in /database")?;
            Ok(format!("{base}/{SOAK_DATABASE}"))
        }
    }
}

fn free_addr() -> Res<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn start(
    name: &'static str,
    bin: &PathBuf,
    addr: SocketAddr,
    env: &[(&str, String)],
    logs: &std::path::Path,
) -> Res<Service> {
    let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
    let mut command = Command::new(bin);
    command
        .args(["--addr", &addr.to_string()])
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
        )
        .stdout(log.try_clone()?)
        .stderr(log);
    for (key, value) in env {
        command.env(key, value);
    }
    Ok(Service {
        name,
        child: command.spawn()?,
    })
}

/// Waits until `path` answers on `addr` (any status), for 60 s at most.
async fn await_healthy(addr: SocketAddr, path: &str, name: &str) -> Res<()> {
    let started = Instant::now();
    loop {
        // Any answer means the service is up (a POST without a key answers 4xx).
        let probe = Post {
            path,
            key: None,
            cookie: None,
            body: b"{}",
        };
        if let Ok(mut connection) = Connection::open(addr).await
            && connection.post(probe).await.is_ok()
        {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!("the {name} example did not listen on {addr} within 60 s").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// CPU seconds spent so far by the soak's services and by the database servers on the machine.
#[derive(Debug, Clone)]
struct Cpu {
    payments: f64,
    gateway: f64,
    /// Every `postgres` and `mariadbd`/`mysqld` process (the machine is otherwise quiet), by
    /// pid: a server process that ends in a window takes its seconds with it, so a window
    /// counts each process against its own earlier reading.
    servers: std::collections::HashMap<u32, f64>,
}

impl Cpu {
    fn read(payments: &Service, gateway: &Service) -> Self {
        let mut servers = std::collections::HashMap::new();
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for entry in entries.flatten() {
                let Some(pid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|p| p.parse::<u32>().ok())
                else {
                    continue;
                };
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                if matches!(comm.trim(), "postgres" | "mariadbd" | "mysqld") {
                    servers.insert(pid, cpu_seconds(pid));
                }
            }
        }
        Cpu {
            payments: cpu_seconds(payments.child.id()),
            gateway: cpu_seconds(gateway.child.id()),
            servers,
        }
    }

    /// The servers' CPU seconds since `before`.
    fn servers_since(&self, before: &Cpu) -> f64 {
        self.servers
            .iter()
            .map(|(pid, now)| now - before.servers.get(pid).copied().unwrap_or(0.0))
            .sum()
    }
}

/// The machine's speed, sampled every 5 s through the soak: the CPU time (the scheduler's, in
/// ms, steal left out) of a fixed piece of work, SHA-256 of 16 MiB, the least of three tries.
/// All the soak's processes run on the same cores, so when the machine slows (its host's
/// other tenants, its clock) each one's CPU per call grows alike; a window's throughput
/// times its median sample, against the first window's, tells the service's slope from the
/// machine's.
struct Calibration {
    samples: Arc<Mutex<Vec<f64>>>,
    stop: Arc<AtomicBool>,
}

impl Calibration {
    fn start() -> Self {
        let (samples, stop) = (
            Arc::new(Mutex::new(Vec::new())),
            Arc::new(AtomicBool::new(false)),
        );
        let (into, stopped) = (samples.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                if let Some(ms) = Self::sample() {
                    into.lock().unwrap_or_else(|e| e.into_inner()).push(ms);
                }
                std::thread::sleep(Duration::from_secs(5));
            }
        });
        Calibration { samples, stop }
    }

    /// One sample: the least CPU time of three runs of the work, in ms.
    fn sample() -> Option<f64> {
        use sha2::Digest;
        let run_ns = || -> Option<u64> {
            let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
            stat.split_whitespace().next()?.parse().ok()
        };
        let data = vec![0x5a_u8; 16 << 20];
        (0..3)
            .filter_map(|_| {
                let before = run_ns()?;
                std::hint::black_box(sha2::Sha256::digest(std::hint::black_box(&data)));
                Some(run_ns()?.saturating_sub(before))
            })
            .min()
            .map(|ns| ns as f64 / 1e6)
    }

    /// The median of the samples since the last call (NaN without one).
    fn window_ms(&self) -> f64 {
        let mut samples =
            std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()));
        samples.sort_by(f64::total_cmp);
        samples.get(samples.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

impl Drop for Calibration {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// User and system CPU seconds of process `pid` (Linux: /proc; 0 once it is gone).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command's closing parenthesis; utime and stime are the 12th and
    // 13th of them, in clock ticks (100 a second on Linux).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// The size of the SQLite file at `path` with its WAL, in MB.
fn file_mb(path: &std::path::Path) -> f64 {
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let wal = path.with_extension("db-wal");
    (size(path) + size(&wal)) as f64 / 1e6
}

/// The resident memory of process `pid`, in MB (Linux: /proc).
fn rss_mb(pid: u32) -> Res<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .ok_or("no VmRSS in /proc/<pid>/status")?;
    Ok(kb / 1024.0)
}

async fn rows(db: &DatabaseConnection, table: &str) -> Res<i64> {
    scalar(db, &format!("SELECT COUNT(*) FROM {table}")).await
}

/// The first column of the one row `sql` answers.
async fn scalar<T: TryGetable>(db: &DatabaseConnection, sql: &str) -> Res<T> {
    let row = db
        .query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await?
        .ok_or_else(|| format!("`{sql}` answered no row"))?;
    Ok(row.try_get_by_index::<T>(0)?)
}
