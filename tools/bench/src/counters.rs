//! What the machine and the database server count: CPU time, server counters, memory, load,
//! and the facts printed at the top of the report.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use sea_orm::{DatabaseConnection, DbBackend};

use crate::Res;
use crate::setup::scalar;

/// Adds to `into` each counter's change from `before` to `after`.
pub(crate) fn add_deltas(
    into: &mut BTreeMap<&'static str, f64>,
    before: &BTreeMap<&'static str, f64>,
    after: BTreeMap<&'static str, f64>,
) {
    for (k, x) in after {
        if let Some(z) = before.get(k) {
            *into.entry(k).or_default() += x - z;
        }
    }
}

/// Busy and total jiffies of the whole machine (`/proc/stat`).
pub(crate) fn machine_cpu() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<f64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    let idle = v.get(3)? + v.get(4)?;
    let total: f64 = v.iter().take(8).sum();
    Some((total - idle, total))
}

/// Server-wide counters that explain throughput: WAL bytes (PostgreSQL); row-lock waits,
/// deadlocks, log fsyncs and bytes (MySQL/MariaDB). Other clients of the server add noise.
pub(crate) async fn server_counters(db: &DatabaseConnection) -> BTreeMap<&'static str, f64> {
    let mut out = BTreeMap::new();
    let queries: &[(&'static str, &str)] = match db.get_database_backend() {
        DbBackend::Postgres => &[(
            "wal_bytes",
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::BIGINT",
        )],
        DbBackend::MySql => &[
            ("row_lock_waits", "INNODB_ROW_LOCK_WAITS"),
            ("row_lock_time_ms", "INNODB_ROW_LOCK_TIME"),
            ("deadlocks", "INNODB_DEADLOCKS"),
            ("log_fsyncs", "INNODB_OS_LOG_FSYNCS"),
            ("log_bytes", "INNODB_OS_LOG_WRITTEN"),
        ],
        _ => &[],
    };
    for (key, query) in queries {
        let sql = if db.get_database_backend() == DbBackend::MySql {
            format!(
                "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = '{query}'"
            )
        } else {
            (*query).to_owned()
        };
        if let Ok(v) = scalar(db, &sql).await
            && let Ok(v) = v.parse::<f64>()
        {
            out.insert(*key, v);
        }
    }
    out
}

/// CPU time of a process in µs (`/proc/<pid>/stat`, all threads, 10 ms ticks).
pub(crate) fn process_cpu_us(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks * 10_000.0)
}

/// CPU time of one server process (a PostgreSQL backend) in µs, ns precision.
pub(crate) fn schedstat_us(pid: &str) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).ok()?;
    Some(s.split_whitespace().next()?.parse::<f64>().ok()? / 1000.0)
}

/// The server process whose CPU the profile reads, and how.
pub(crate) async fn server_process(db: &DatabaseConnection) -> Option<(String, bool)> {
    match db.get_database_backend() {
        DbBackend::Postgres => {
            let pid = scalar(db, "SELECT pg_backend_pid()").await.ok()?;
            Some((pid, true))
        }
        DbBackend::MySql => {
            let file = scalar(db, "SELECT @@pid_file").await.ok()?;
            let pid = std::fs::read_to_string(file).ok()?.trim().to_owned();
            Some((pid, false))
        }
        _ => None,
    }
}

pub(crate) fn server_cpu_us(server: Option<&(String, bool)>) -> Option<f64> {
    let (pid, precise) = server?;
    if *precise {
        schedstat_us(pid)
    } else {
        process_cpu_us(pid)
    }
}

pub(crate) fn read_proc(path: &str, key: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()?.lines().find_map(|l| {
        l.strip_prefix(key)
            .map(|v| v.trim_start_matches([':', ' ', '\t']).trim().to_owned())
    })
}

pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let v = read_proc("/proc/self/status", "VmHWM")?;
    Some(v.split_whitespace().next()?.parse::<u64>().ok()? * 1024)
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The CPU flags that decide how fast SHA-256 runs (`sha_ni`: SHA extensions, `avx2`,
/// `ssse3`), those of them `/proc/cpuinfo` lists.
pub(crate) fn hashing_cpu_flags() -> Vec<&'static str> {
    let flags = read_proc("/proc/cpuinfo", "flags").unwrap_or_default();
    let present: Vec<&str> = flags.split_whitespace().collect();
    ["sha_ni", "avx2", "ssse3"]
        .into_iter()
        .filter(|f| present.contains(f))
        .collect()
}

fn unix_seconds() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default() as i64
}

/// The UTC date and time, `2026-11-24T11:05:00Z`.
pub(crate) fn utc_now() -> String {
    let secs = unix_seconds();
    let of_day = secs.rem_euclid(86_400);
    format!(
        "{}T{:02}:{:02}:{:02}Z",
        civil_date(secs.div_euclid(86_400)),
        of_day / 3_600,
        of_day % 3_600 / 60,
        of_day % 60
    )
}

/// Today's UTC date.
pub(crate) fn utc_date() -> String {
    civil_date(unix_seconds().div_euclid(86_400))
}

/// The date of a day since 1970-01-01 (civil-from-days, no dependency).
fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

pub(crate) async fn server_facts(db: &DatabaseConnection) -> Res<(String, String)> {
    Ok(match db.get_database_backend() {
        DbBackend::Postgres => (
            scalar(db, "SELECT version()").await?,
            format!(
                "synchronous_commit={}, fsync={}, wal_sync_method={}",
                scalar(db, "SHOW synchronous_commit").await?,
                scalar(db, "SHOW fsync").await?,
                scalar(db, "SHOW wal_sync_method").await?
            ),
        ),
        DbBackend::MySql => (
            format!("MySQL/MariaDB {}", scalar(db, "SELECT version()").await?),
            format!(
                "innodb_flush_log_at_trx_commit={}, binlog={}",
                scalar(db, "SELECT @@innodb_flush_log_at_trx_commit").await?,
                scalar(db, "SELECT @@log_bin").await?
            ),
        ),
        _ => (
            format!("SQLite {}", scalar(db, "SELECT sqlite_version()").await?),
            format!(
                "journal_mode={}, synchronous={} (2 = FULL)",
                scalar(db, "PRAGMA journal_mode").await?,
                scalar(db, "PRAGMA synchronous").await?
            ),
        ),
    })
}
