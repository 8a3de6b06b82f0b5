//! P12: what a claim and a replay cost as the ledger grows (`--ledger-records N[,N…]`), and
//! the ledger's bytes per record.
//!
//! For each size, smallest first, the ledger is topped up with live completed records (bulk
//! SQL, shaped like real ones: 36-character keys, the 142-byte receipt, a day to live), then
//! claims (a new key through the ledger path alone: claim, record, commit of an empty body)
//! and replays (a key claimed earlier at this size) take turns, one each per step. The
//! replays read recent records, as retries do; the bulk-inserted records are never replayed
//! (their ids are not the ids idem derives from a key).

use std::time::Instant;

use sea_orm::{ConnectionTrait, DbBackend};

use crate::Res;
use crate::harness::{percentile, us};
use crate::ledger::{Synthetic, claim_only, insert_synthetic, ledger_bytes};
use crate::setup::{Bench, Plan};

/// Claims (and as many replays) before the timed ones at each size.
const WARM_UP: usize = 200;

/// One ledger size's figures.
#[derive(Debug, Clone)]
pub(crate) struct AtSize {
    /// Synthetic live records in the ledger (the bench's own records come on top).
    pub(crate) records: u64,
    pub(crate) claim_us: Vec<f64>,
    pub(crate) replay_us: Vec<f64>,
    /// The ledger's growth on disk (table and indexes) over the records added since P12
    /// began, synthetic and claimed.
    pub(crate) bytes_per_record: f64,
    /// Seconds the top-up to this size took (insert and statistics).
    pub(crate) fill_s: f64,
}

impl AtSize {
    pub(crate) fn claim_p50(&self) -> f64 {
        percentile(&self.claim_us, 0.5)
    }
    pub(crate) fn claim_p99(&self) -> f64 {
        percentile(&self.claim_us, 0.99)
    }
    pub(crate) fn replay_p50(&self) -> f64 {
        percentile(&self.replay_us, 0.5)
    }
    pub(crate) fn replay_p99(&self) -> f64 {
        percentile(&self.replay_us, 0.99)
    }
}

/// P12's figures, one entry per size asked for, smallest first (empty without
/// `--ledger-records`).
#[derive(Debug, Default)]
pub(crate) struct Growth {
    pub(crate) sizes: Vec<AtSize>,
    /// Bytes of the receipt each synthetic record carries.
    pub(crate) response_bytes: usize,
}

/// The sizes the P12 goal compares on PostgreSQL.
pub(crate) const GOAL_SMALL: u64 = 100_000;
pub(crate) const GOAL_LARGE: u64 = 10_000_000;

impl Growth {
    fn at(&self, records: u64) -> Option<&AtSize> {
        self.sizes.iter().find(|s| s.records == records)
    }

    /// The two sizes a growth figure compares: 10,000,000 against 100,000 where both were
    /// measured (the goal's), else the largest against the smallest; `None` with fewer than
    /// two sizes.
    pub(crate) fn compared(&self) -> Option<(&AtSize, &AtSize)> {
        if let (Some(large), Some(small)) = (self.at(GOAL_LARGE), self.at(GOAL_SMALL)) {
            return Some((large, small));
        }
        let (small, large) = (self.sizes.first()?, self.sizes.last()?);
        (self.sizes.len() > 1).then_some((large, small))
    }

    /// Claim p99 at the larger compared size over the smaller.
    pub(crate) fn claim_p99_growth(&self) -> Option<f64> {
        self.compared()
            .map(|(large, small)| large.claim_p99() / small.claim_p99())
    }

    /// Replay p99 at the larger compared size over the smaller.
    pub(crate) fn replay_p99_growth(&self) -> Option<f64> {
        self.compared()
            .map(|(large, small)| large.replay_p99() / small.replay_p99())
    }

    /// Whether the growth figures compare the goal's sizes (10,000,000 against 100,000).
    pub(crate) fn compares_goal_sizes(&self) -> bool {
        self.compared()
            .is_some_and(|(l, s)| l.records == GOAL_LARGE && s.records == GOAL_SMALL)
    }

    /// Bytes per record at the largest size.
    pub(crate) fn bytes_per_record(&self) -> Option<f64> {
        self.sizes.last().map(|s| s.bytes_per_record)
    }
}

/// Refreshes what the planner and the size figures read after a bulk insert, and leaves no
/// pending work (WAL, dead tuples, hint bits) for the timed claims to pay.
async fn settle(b: &Bench) -> Res<()> {
    match b.db.get_database_backend() {
        DbBackend::Postgres => {
            b.db.execute_unprepared("VACUUM ANALYZE idem_ledger")
                .await?;
            // The bulk insert's WAL would otherwise be checkpointed while the claims are
            // timed. CHECKPOINT needs a superuser or pg_checkpoint: without, the claims pay.
            let _ = b.db.execute_unprepared("CHECKPOINT").await;
        }
        DbBackend::MySql => {
            b.db.execute_unprepared("ANALYZE TABLE idem_ledger").await?;
        }
        _ => {
            b.db.execute_unprepared("PRAGMA wal_checkpoint(TRUNCATE)")
                .await?;
        }
    }
    Ok(())
}

/// P12 over `sizes` (records, sorted and deduplicated here): top up, settle, time.
pub(crate) async fn measure(b: &Bench, plan: &Plan, sizes: &[u64]) -> Res<Growth> {
    let mut sizes = sizes.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.is_empty() {
        return Ok(Growth::default());
    }
    let receipt =
        crate::variants::pay_idem(&b.db, b.command(crate::setup::SLOT_LATENCY, 2), &b.sql).await?;
    b.executed
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let response = serde_json::to_vec(&receipt)?;
    let bytes_at_start = ledger_bytes(&b.db).await?;
    let (mut inserted, mut claimed) = (0_u64, 0_u64);
    let mut out = Growth {
        sizes: Vec::new(),
        response_bytes: response.len(),
    };
    for records in sizes {
        let start = Instant::now();
        if records > inserted {
            insert_synthetic(b, Synthetic::Live, inserted + 1, records, &response).await?;
            inserted = records;
        }
        settle(b).await?;
        let fill_s = start.elapsed().as_secs_f64();
        let bytes = ledger_bytes(&b.db).await?;
        let bytes_per_record = (bytes - bytes_at_start) as f64 / (inserted + claimed) as f64;
        b.progress(&format!(
            "p12: {records} live records in the ledger ({fill_s:.1} s), {bytes_per_record:.0} \
             bytes per record"
        ));
        let (claim_us, replay_us) = claims_and_replays(b, plan.growth_calls).await?;
        claimed += (WARM_UP + plan.growth_calls) as u64;
        out.sizes.push(AtSize {
            records,
            claim_us,
            replay_us,
            bytes_per_record,
            fill_s,
        });
    }
    Ok(out)
}

/// `calls` claims of new keys and as many replays of keys claimed before them, taking turns
/// (claim first on even steps, replay first on odd ones), after [`WARM_UP`] of each: µs.
async fn claims_and_replays(b: &Bench, calls: usize) -> Res<(Vec<f64>, Vec<f64>)> {
    let (mut claim_us, mut replay_us) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
    let mut keys: Vec<String> = Vec::with_capacity(WARM_UP + calls);
    for step in 0..WARM_UP + calls {
        let timed = step >= WARM_UP;
        for replay in [step % 2 == 1, step % 2 == 0] {
            // A key claimed earlier at this size, spread over them (a prime stride).
            let key = match (replay, keys.len()) {
                (true, 0) => continue,
                (true, n) => keys[(step * 7_919) % n].clone(),
                (false, _) => b.new_key(),
            };
            let start = Instant::now();
            claim_only(&b.db, key.clone()).await?;
            let took = us(start.elapsed());
            match (replay, timed) {
                (true, true) => replay_us.push(took),
                (false, true) => claim_us.push(took),
                _ => {}
            }
            if !replay {
                keys.push(key);
            }
        }
    }
    Ok((claim_us, replay_us))
}
