//! The ledger's size on disk per million records, and P7: claim latency while expired records
//! are purged (full mode), against the same records in place and no purge.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem::idempotent;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};

use crate::Res;
use crate::harness::{median, percentile, us};
use crate::setup::{BULK_CHUNK, Bench, Plan, PurgePlan, SLOT_LATENCY, scalar};
use crate::variants::pay_idem;

/// How a P7 cycle purges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PurgeHow {
    /// `purge_expired(db, batch)`, as the README shows it (P7 is measured this way).
    Batch(u32),
    /// What would close P7: statements sized to take about [`PACED_BUDGET`] each, with an
    /// equal pause after each, built on `ExpiredPurge`.
    Paced,
}

/// The batch size the README shows for `purge_expired`.
pub(crate) const README_BATCH: u32 = 200;
/// The largest statement a paced purge makes.
const PACED_MAX_BATCH: u32 = 10_000;
/// Target duration of one paced purge statement.
pub(crate) const PACED_BUDGET: Duration = Duration::from_millis(2);

/// The ledger path alone (claim, record, commit) for P7.
#[idempotent(scope = "bench.claim", key = key)]
pub(crate) async fn claim_only(db: &DatabaseConnection, key: String) -> Result<u8, idem::Error> {
    let _ = db;
    Ok(1)
}

/// Bytes the ledger occupies on disk.
pub(crate) async fn ledger_bytes(db: &DatabaseConnection) -> Res<i64> {
    let v = match db.get_database_backend() {
        DbBackend::Postgres => {
            scalar(db, "SELECT pg_total_relation_size('idem_ledger')::BIGINT").await?
        }
        DbBackend::MySql => {
            db.execute_unprepared("ANALYZE TABLE idem_ledger").await?;
            scalar(
                db,
                "SELECT CAST(data_length + index_length AS SIGNED) FROM information_schema.TABLES \
                 WHERE table_schema = DATABASE() AND table_name = 'idem_ledger'",
            )
            .await?
        }
        // Pages in use (freed pages are reused before the file grows).
        _ => {
            let pages: i64 = scalar(db, "PRAGMA page_count").await?.parse()?;
            let free: i64 = scalar(db, "PRAGMA freelist_count").await?.parse()?;
            let size: i64 = scalar(db, "PRAGMA page_size").await?.parse()?;
            return Ok((pages - free) * size);
        }
    };
    Ok(v.parse()?)
}

/// Synthetic ledger records: completed ones, shaped like real ones (36-character keys, a
/// recorded receipt), inserted in bulk SQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Synthetic {
    /// Expired a minute ago (P7 purges them, the ledger's size is measured over them).
    Expired,
    /// Live for a day (P12 measures claims and replays among them).
    Live,
}

impl Synthetic {
    /// Hashed with the record's number into its id, so the two kinds never collide.
    fn id_prefix(self) -> &'static str {
        match self {
            Self::Expired => "bench-expired-",
            Self::Live => "bench-live-",
        }
    }
}

/// Inserts synthetic records `from..=to` of `kind`, in bulk SQL.
pub(crate) async fn insert_synthetic(
    b: &Bench,
    kind: Synthetic,
    from: u64,
    to: u64,
    response: &[u8],
) -> Res<()> {
    let db = &b.db;
    let backend = db.get_database_backend();
    let now = idem::sea_orm::database_now_ms(db).await?;
    // Record n expires at `base - n` and was created a day before: expired ones a minute ago
    // and earlier, live ones within the next day (n ms before now + 1 day).
    let base = match kind {
        Synthetic::Expired => now - 60_000,
        Synthetic::Live => now + 86_400_000,
    };
    let prefix = kind.id_prefix();
    let cols = "id, scope, principal, idem_key, owner, fingerprint, state, response, created_at_ms, expires_at_ms";
    let mut lo = from;
    while lo <= to {
        let hi = (lo + BULK_CHUNK - 1).min(to);
        let (lo_v, hi_v) = (i64::try_from(lo)?, i64::try_from(hi)?);
        let stmt = match backend {
            DbBackend::Postgres => Statement::from_sql_and_values(
                backend,
                format!(
                    "INSERT INTO idem_ledger ({cols}) SELECT sha256(('{prefix}' || n)::bytea), \
                     'bench.pay', '', 'k-' || lpad(n::text, 34, '0'), n, sha256(('fp-' || n)::bytea), 1, \
                     $3::bytea, $4::bigint - 86400000 - n, $4::bigint - n \
                     FROM generate_series($1::bigint, $2::bigint) AS n"
                ),
                [
                    lo_v.into(),
                    hi_v.into(),
                    response.to_vec().into(),
                    base.into(),
                ],
            ),
            DbBackend::MySql => {
                let digits = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                    UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                    UNION ALL SELECT 8 UNION ALL SELECT 9)";
                Statement::from_sql_and_values(
                    backend,
                    format!(
                        "INSERT INTO idem_ledger ({cols}) SELECT UNHEX(SHA2(CONCAT('{prefix}', n), 256)), \
                         'bench.pay', '', CONCAT('k-', LPAD(n, 34, '0')), n, UNHEX(SHA2(CONCAT('fp-', n), 256)), 1, \
                         ?, ? - 86400000 - n, ? - n FROM (SELECT ? + a.d + 10 * b.d + 100 * c.d + 1000 * e.d \
                         + 10000 * f.d AS n FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f) \
                         AS seq WHERE n <= ?"
                    ),
                    [
                        response.to_vec().into(),
                        base.into(),
                        base.into(),
                        lo_v.into(),
                        hi_v.into(),
                    ],
                )
            }
            _ => Statement::from_sql_and_values(
                backend,
                format!(
                    "WITH RECURSIVE s(n) AS (SELECT ? UNION ALL SELECT n + 1 FROM s WHERE n < ?) \
                     INSERT INTO idem_ledger ({cols}) SELECT randomblob(32), 'bench.pay', '', \
                     printf('k-%034d', n), n, randomblob(32), 1, ?, ? - 86400000 - n, ? - n FROM s"
                ),
                [
                    lo_v.into(),
                    hi_v.into(),
                    response.to_vec().into(),
                    base.into(),
                    base.into(),
                ],
            ),
        };
        db.execute_raw(stmt).await?;
        lo = hi + 1;
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct LedgerSize {
    pub(crate) rows: u64,
    bytes_before: i64,
    bytes_after: i64,
    pub(crate) insert_s: f64,
}

impl LedgerSize {
    pub(crate) fn per_million(&self) -> f64 {
        (self.bytes_after - self.bytes_before) as f64 * 1e6 / self.rows as f64
    }
}

async fn insert_and_measure(b: &Bench, rows: u64, response: &[u8]) -> Res<LedgerSize> {
    let bytes_before = ledger_bytes(&b.db).await?;
    let start = Instant::now();
    insert_synthetic(b, Synthetic::Expired, 1, rows, response).await?;
    let insert_s = start.elapsed().as_secs_f64();
    if b.db.get_database_backend() == DbBackend::Postgres {
        b.db.execute_unprepared("ANALYZE idem_ledger").await?;
    }
    Ok(LedgerSize {
        rows,
        bytes_before,
        bytes_after: ledger_bytes(&b.db).await?,
        insert_s,
    })
}

/// One claim (claim, record, commit of an empty body), in µs.
async fn one_claim(b: &Bench) -> Res<f64> {
    let key = b.new_key();
    let start = Instant::now();
    claim_only(&b.db, key).await?;
    Ok(us(start.elapsed()))
}

#[derive(Debug)]
pub(crate) struct PurgeCycle {
    pub(crate) how: PurgeHow,
    pub(crate) statements: u64,
    /// Median rows per statement.
    pub(crate) batch: f64,
    size: LedgerSize,
    pub(crate) baseline_us: Vec<f64>,
    pub(crate) during_us: Vec<f64>,
    pub(crate) deleted: u64,
    pub(crate) purge_s: f64,
}

impl PurgeCycle {
    pub(crate) fn ratio(&self) -> f64 {
        percentile(&self.during_us, 0.99) / percentile(&self.baseline_us, 0.99)
    }
}

/// Deletes every expired record in statements sized to take about [`PACED_BUDGET`], pausing as
/// long as each statement took: returns rows deleted, statements, median rows per statement.
async fn purge_paced(db: &DatabaseConnection) -> Result<(u64, u64, f64), idem::Error> {
    let (mut batch, mut sizes) = (500_u32, Vec::new());
    let mut purge = idem::sea_orm::ExpiredPurge::new();
    loop {
        let start = Instant::now();
        purge.step(db, batch).await?;
        let took = start.elapsed();
        sizes.push(f64::from(batch));
        if purge.is_finished() {
            return Ok((purge.deleted(), sizes.len() as u64, median(&sizes)));
        }
        let scale = (PACED_BUDGET.as_secs_f64() / took.as_secs_f64().max(1e-5)).clamp(0.5, 2.0);
        batch = ((f64::from(batch) * scale) as u32).clamp(10, PACED_MAX_BATCH);
        tokio::time::sleep(took).await;
    }
}

/// P7: p99 claim latency while expired records are purged, against the p99 with the same
/// records in place and no purge.
async fn purge_cycle(
    b: &Arc<Bench>,
    p: &PurgePlan,
    how: PurgeHow,
    response: &[u8],
) -> Res<PurgeCycle> {
    let size = insert_and_measure(b, p.rows, response).await?;
    b.progress(&format!(
        "p7: inserted {} expired records in {:.1} s",
        p.rows, size.insert_s
    ));
    let mut baseline_us = Vec::new();
    let start = Instant::now();
    while start.elapsed() < p.baseline {
        baseline_us.push(one_claim(b).await?);
    }
    let db = b.db.clone();
    let purge = tokio::spawn(async move {
        let start = Instant::now();
        let done = match how {
            PurgeHow::Batch(batch) => idem::sea_orm::purge_expired(&db, batch)
                .await
                .map(|n| (n, n.div_ceil(u64::from(batch)).max(1), f64::from(batch))),
            PurgeHow::Paced => purge_paced(&db).await,
        };
        (done, start.elapsed())
    });
    let mut during_us = Vec::new();
    while !purge.is_finished() {
        during_us.push(one_claim(b).await?);
    }
    let (done, took) = purge.await?;
    let (deleted, statements, batch) = done?;
    b.progress(&format!(
        "p7 ({how:?}): purged {deleted} records in {:.1} s; {} claims meanwhile",
        took.as_secs_f64(),
        during_us.len()
    ));
    Ok(PurgeCycle {
        how,
        statements,
        batch,
        size,
        baseline_us,
        during_us,
        deleted,
        purge_s: took.as_secs_f64(),
    })
}

/// The ledger's figures: its size per million records, and the purge cycles (P7, full mode).
#[derive(Debug)]
pub(crate) struct Ledger {
    pub(crate) size: LedgerSize,
    /// Bytes of the recorded receipt each synthetic record carries.
    pub(crate) response_bytes: usize,
    /// P7's cycles, in the plan's order (none in quick mode).
    pub(crate) cycles: Vec<PurgeCycle>,
    /// Quick mode's single purge of the synthetic records: records deleted and seconds.
    pub(crate) quick_purge: Option<(u64, f64)>,
}

impl Ledger {
    /// P7: the median ratio of the cycles that purge as the README shows (`None` in quick mode).
    pub(crate) fn p7_ratio(&self) -> Option<f64> {
        let documented: Vec<f64> = self
            .cycles
            .iter()
            .filter(|c| c.how == PurgeHow::Batch(README_BATCH))
            .map(PurgeCycle::ratio)
            .collect();
        (!documented.is_empty()).then(|| median(&documented))
    }
}

/// The ledger's size per million records; in full mode P7's purge cycles, whose first cycle
/// measures the size; in quick mode one insert and one purge of the plan's synthetic records.
pub(crate) async fn measure(b: &Arc<Bench>, plan: &Plan) -> Res<Ledger> {
    // A real receipt, so synthetic records are as large as recorded ones.
    let receipt = pay_idem(&b.db, b.command(SLOT_LATENCY, 1), &b.sql).await?;
    b.executed.fetch_add(1, Ordering::Relaxed);
    let response = serde_json::to_vec(&receipt)?;
    let mut cycles = Vec::new();
    if let Some(p) = plan.purge {
        for &how in p.cycles {
            cycles.push(purge_cycle(b, &p, how, &response).await?);
        }
    }
    let (size, quick_purge) = match cycles.first() {
        Some(c) => (c.size, None),
        None => {
            let size = insert_and_measure(b, plan.ledger_rows, &response).await?;
            let start = Instant::now();
            let deleted = idem::sea_orm::purge_expired(&b.db, 10_000).await?;
            let took = start.elapsed().as_secs_f64();
            b.progress(&format!(
                "ledger: {} synthetic records inserted in {:.1} s, purged in {took:.1} s",
                plan.ledger_rows, size.insert_s
            ));
            (size, Some((deleted, took)))
        }
    };
    Ok(Ledger {
        size,
        response_bytes: response.len(),
        cycles,
        quick_purge,
    })
}
