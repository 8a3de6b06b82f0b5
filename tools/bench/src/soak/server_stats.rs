//! What the soak's database server says it spent, window by window: the attribution R22 asks
//! for before anything is changed. A slope in the soak's figures is either a statement whose
//! time per call grows (a scan that grows with a table, a plan that changes as it grows) or
//! something in the processes; this tells which statement, and which table is read whole.
//!
//! - PostgreSQL: `pg_stat_statements` (the server must preload it:
//!   `shared_preload_libraries = 'pg_stat_statements'`) for each statement's calls, time and
//!   blocks touched, and `pg_stat_user_tables` for sequential scans and dead rows.
//! - MariaDB/MySQL: `performance_schema.events_statements_summary_by_digest` (the server must
//!   run with `performance_schema = ON`; MariaDB's default is off) for calls, time and rows
//!   examined.
//!
//! Where the server cannot say (no extension, no performance schema, SQLite), the soak prints
//! why once and goes on without.

use std::collections::HashMap;

use sea_orm::{ConnectionTrait, DatabaseBackend, DatabaseConnection, Statement};

use super::scalar;
use crate::Res;

/// How many statements a window lists (those that took the most time in it).
const TOP_STATEMENTS: usize = 6;

/// One statement's running totals, as the server counts them.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    calls: i64,
    millis: f64,
    /// Blocks touched (PostgreSQL) or rows examined (MySQL): what grows when a scan grows.
    work: i64,
}

/// One table's running totals (PostgreSQL).
#[derive(Debug, Clone, Copy, Default)]
struct TableTotals {
    seq_scans: i64,
    seq_rows: i64,
    dead_rows: i64,
}

/// The totals at the end of the last window, to print each window's differences.
#[derive(Debug)]
pub(super) struct ServerStats {
    backend: DatabaseBackend,
    statements: HashMap<String, (Totals, String)>,
    tables: HashMap<String, TableTotals>,
    /// InnoDB's counters (MySQL), by [`INNODB_COUNTERS`] name.
    innodb: HashMap<String, i64>,
}

/// InnoDB's counters that grow when a scan or the working set grows, printed per window on
/// MySQL (its statement digests leave out the statements run through the binary protocol,
/// which are idem's): rows read by table scans (`Handler_read_rnd_next`), buffer pool page
/// requests, pages it had to read from disk, and fsyncs.
const INNODB_COUNTERS: &str = "SELECT VARIABLE_NAME, CAST(VARIABLE_VALUE AS SIGNED) \
     FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME IN ('HANDLER_READ_RND_NEXT', \
     'INNODB_BUFFER_POOL_READ_REQUESTS', 'INNODB_BUFFER_POOL_READS', 'INNODB_DATA_FSYNCS')";

impl ServerStats {
    /// Starts counting on the soak's database, or says why it cannot and returns `None`.
    pub(super) async fn start(db: &DatabaseConnection) -> Option<Self> {
        let mut stats = Self {
            backend: db.get_database_backend(),
            statements: HashMap::new(),
            tables: HashMap::new(),
            innodb: HashMap::new(),
        };
        // The first reading is the baseline the first window is measured against.
        let ready = async {
            stats.enable(db).await?;
            stats.window(db).await
        };
        match ready.await {
            Ok(_) => Some(stats),
            Err(why) => {
                println!("soak: no server statistics ({why})");
                None
            }
        }
    }

    /// Makes the server's statistics readable and zeroes them (PostgreSQL), or checks that it
    /// keeps them (MySQL).
    async fn enable(&self, db: &DatabaseConnection) -> Res<()> {
        match self.backend {
            DatabaseBackend::Postgres => {
                db.execute_unprepared("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                    .await?;
                db.execute_unprepared("SELECT pg_stat_statements_reset()")
                    .await?;
                let autovacuum: String = scalar(db, "SELECT current_setting('autovacuum')").await?;
                println!("soak: the server's autovacuum is {autovacuum}");
                Ok(())
            }
            DatabaseBackend::MySql => match scalar::<i64>(db, "SELECT @@performance_schema").await?
            {
                1 => Ok(()),
                _ => Err("performance_schema is OFF on this server".into()),
            },
            _ => Err("SQLite keeps no statement statistics".into()),
        }
    }

    /// The window's lines: the statements that took the most time since the last window (calls,
    /// mean time, blocks or rows per call), and the tables scanned sequentially.
    pub(super) async fn window(&mut self, db: &DatabaseConnection) -> Res<Vec<String>> {
        let statements = self.read_statements(db).await?;
        let mut lines = Vec::new();
        let mut grown: Vec<(String, Totals)> = statements
            .iter()
            .map(|(id, (now, text))| {
                let before = self.statements.get(id).map(|(t, _)| *t).unwrap_or_default();
                (
                    text.clone(),
                    Totals {
                        calls: now.calls - before.calls,
                        millis: now.millis - before.millis,
                        work: now.work - before.work,
                    },
                )
            })
            .filter(|(_, d)| d.calls > 0)
            .collect();
        grown.sort_by(|a, b| b.1.millis.total_cmp(&a.1.millis));
        let work = match self.backend {
            DatabaseBackend::Postgres => "blocks",
            _ => "rows",
        };
        for (text, d) in grown.iter().take(TOP_STATEMENTS) {
            lines.push(format!(
                "{:>13} calls {:>8.3} ms {:>7.1} {work}/call  {text}",
                d.calls,
                d.millis / d.calls as f64,
                d.work as f64 / d.calls as f64,
            ));
        }
        self.statements = statements;
        if self.backend == DatabaseBackend::Postgres {
            let tables = read_tables(db).await?;
            for (name, now) in &tables {
                let before = self.tables.get(name).copied().unwrap_or_default();
                if now.seq_scans > before.seq_scans {
                    lines.push(format!(
                        "{:>13} sequential scans of {name}, {} rows read, {} dead rows now",
                        now.seq_scans - before.seq_scans,
                        now.seq_rows - before.seq_rows,
                        now.dead_rows
                    ));
                }
            }
            self.tables = tables;
        }
        if self.backend == DatabaseBackend::MySql {
            let innodb = read_innodb(db).await?;
            let grown = |name: &str| {
                innodb.get(name).copied().unwrap_or_default()
                    - self.innodb.get(name).copied().unwrap_or_default()
            };
            lines.push(format!(
                "{:>13} rows read by table scans, {} InnoDB page requests, {} pages read from \
                 disk, {} fsyncs",
                grown("HANDLER_READ_RND_NEXT"),
                grown("INNODB_BUFFER_POOL_READ_REQUESTS"),
                grown("INNODB_BUFFER_POOL_READS"),
                grown("INNODB_DATA_FSYNCS"),
            ));
            self.innodb = innodb;
        }
        Ok(lines)
    }

    async fn read_statements(
        &self,
        db: &DatabaseConnection,
    ) -> Res<HashMap<String, (Totals, String)>> {
        let sql = match self.backend {
            DatabaseBackend::Postgres => {
                "SELECT queryid::text, calls, total_exec_time, shared_blks_hit + shared_blks_read, \
                 regexp_replace(query, '\\s+', ' ', 'g') FROM pg_stat_statements \
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
            }
            _ => {
                // The counters are BIGINT UNSIGNED and the timer picoseconds: read as signed
                // integers (microseconds for the time), which the driver decodes as `i64`.
                "SELECT DIGEST, CAST(COUNT_STAR AS SIGNED), \
                 CAST(SUM_TIMER_WAIT DIV 1000000 AS SIGNED), CAST(SUM_ROWS_EXAMINED AS SIGNED), \
                 DIGEST_TEXT FROM performance_schema.events_statements_summary_by_digest \
                 WHERE SCHEMA_NAME = DATABASE() AND DIGEST IS NOT NULL"
            }
        };
        let rows = db
            .query_all_raw(Statement::from_string(self.backend, sql))
            .await?;
        let mut statements = HashMap::with_capacity(rows.len());
        for row in rows {
            let id: String = row.try_get_by_index(0)?;
            let millis = match self.backend {
                DatabaseBackend::Postgres => row.try_get_by_index::<f64>(2)?,
                _ => row.try_get_by_index::<i64>(2)? as f64 / 1000.0,
            };
            let totals = Totals {
                calls: row.try_get_by_index::<i64>(1)?,
                millis,
                work: row.try_get_by_index::<i64>(3).unwrap_or_default(),
            };
            let text: String = row.try_get_by_index(4).unwrap_or_default();
            statements.insert(id, (totals, text.chars().take(110).collect()));
        }
        Ok(statements)
    }
}

/// InnoDB's running counters ([`INNODB_COUNTERS`]).
async fn read_innodb(db: &DatabaseConnection) -> Res<HashMap<String, i64>> {
    let rows = db
        .query_all_raw(Statement::from_string(
            DatabaseBackend::MySql,
            INNODB_COUNTERS,
        ))
        .await?;
    let mut counters = HashMap::with_capacity(rows.len());
    for row in rows {
        let name: String = row.try_get_by_index(0)?;
        counters.insert(name.to_uppercase(), row.try_get_by_index(1)?);
    }
    Ok(counters)
}

/// The soak database's tables and their sequential scans (PostgreSQL).
async fn read_tables(db: &DatabaseConnection) -> Res<HashMap<String, TableTotals>> {
    let rows = db
        .query_all_raw(Statement::from_string(
            DatabaseBackend::Postgres,
            "SELECT relname::text, seq_scan, seq_tup_read, n_dead_tup FROM pg_stat_user_tables",
        ))
        .await?;
    let mut tables = HashMap::with_capacity(rows.len());
    for row in rows {
        tables.insert(
            row.try_get_by_index::<String>(0)?,
            TableTotals {
                seq_scans: row.try_get_by_index(1)?,
                seq_rows: row.try_get_by_index(2)?,
                dead_rows: row.try_get_by_index(3)?,
            },
        );
    }
    Ok(tables)
}
