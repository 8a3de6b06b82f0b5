//! A PgBouncer of a test's own, in transaction pooling mode, in front of the run's PostgreSQL
//! (Debian's `pgbouncer` package; `.ci/run` installs it). Each test gets its own process on a
//! free port, stopped when the handle drops.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::brokers::free_port;

/// A running PgBouncer.
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    /// The URL of the database through the pooler.
    pub url: String,
}

impl PgBouncer {
    /// Starts a PgBouncer in transaction mode in front of `postgres_url`, with at most
    /// `server_connections` connections to PostgreSQL (one makes every client share a server
    /// connection, which is where named statements collide).
    pub fn start(postgres_url: &str, server_connections: u32) -> Self {
        let target: sqlx::postgres::PgConnectOptions =
            postgres_url.parse().expect("a PostgreSQL URL");
        let (host, port, user) = (target.get_host(), target.get_port(), target.get_username());
        let database = target.get_database().unwrap_or("test").to_owned();
        let dir = std::env::temp_dir().join(super::unique("idem-pgbouncer"));
        std::fs::create_dir_all(&dir).expect("pgbouncer dir");
        // PgBouncer refuses to run as root: it drops to `postgres`, which must reach the dir.
        let _ = Command::new("chmod").arg("0777").arg(&dir).status();
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).expect("users");
        let log = dir.join("pgbouncer.log");
        // A port found free may be taken again before PgBouncer binds it (by another test's
        // client or server); PgBouncer then logs "nowhere to listen on" and exits, while a
        // probe of the port may reach whoever took it. So readiness is PgBouncer's own log line,
        // and a start that could not listen is tried again on another port.
        for _attempt in 0..5 {
            let listen = free_port();
            let ini = format!(
                "[databases]\n{database} = host={host} port={port} dbname={database} user={user}\n\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {users}\npool_mode = transaction\n\
                 default_pool_size = {server_connections}\nmax_client_conn = 200\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 logfile = {log}\npidfile = {pid}\n",
                users = dir.join("users.txt").display(),
                log = log.display(),
                pid = dir.join("pgbouncer.pid").display(),
            );
            let config = dir.join("pgbouncer.ini");
            std::fs::write(&config, ini).expect("pgbouncer.ini");
            let _ = std::fs::remove_file(&log);
            let mut command = Command::new("pgbouncer");
            if std::env::var("USER").map_or(true, |u| u == "root") {
                command.arg("-u").arg("postgres");
            }
            let mut child = command
                .arg(&config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start pgbouncer (Debian's `pgbouncer` package; .ci/run installs it)");
            let listening = format!("listening on 127.0.0.1:{listen}");
            let started = Instant::now();
            loop {
                let logged = std::fs::read_to_string(&log).unwrap_or_default();
                if logged.contains(&listening) {
                    return PgBouncer {
                        child,
                        url: format!("postgres://{user}@127.0.0.1:{listen}/{database}"),
                        dir,
                    };
                }
                if matches!(child.try_wait(), Ok(Some(_))) || logged.contains("FATAL") {
                    let _ = child.kill();
                    let _ = child.wait();
                    break; // another port
                }
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "pgbouncer did not listen on {listen}: {logged}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!(
            "pgbouncer could not listen on five free ports: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
