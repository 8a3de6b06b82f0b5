//! The four ways of paying an order that the bench compares, and a result per variant.
//!
//! - **bare**: the handler body in one plain transaction, no idempotency (the floor);
//! - **three-commit**: the hand-written pattern (commit a processing row, run the body in its
//!   own transaction, commit the result), written directly with SeaORM;
//! - **idem first**: `#[idempotent]`, every call a new key;
//! - **idem replay**: `#[idempotent]`, every call a key already recorded.

use idem::{Fingerprinter, idempotent};
use sea_orm::{ConnectionTrait, DatabaseConnection, TransactionTrait};

use crate::Res;
use crate::workload::{PayOrder, Receipt, Sql, now_ms, pay_body};

/// **bare**: the body in one plain transaction, no idempotency.
pub(crate) async fn pay_bare(db: &DatabaseConnection, sql: &Sql, cmd: &PayOrder) -> Res<Receipt> {
    let tx = db.begin().await?;
    let receipt = pay_body(&tx, sql, cmd).await?;
    tx.commit().await?;
    Ok(receipt)
}

/// **three-commit**: the usual hand-written pattern. Each step is as cheap as it can be
/// written: steps 1 and 3 are single auto-committed statements.
pub(crate) async fn pay_three_commit(
    db: &DatabaseConnection,
    sql: &Sql,
    cmd: &PayOrder,
) -> Res<Receipt> {
    let mut hasher = Fingerprinter::new("bench.pay.manual");
    hasher.arg(cmd)?;
    let hash = hasher.finish().0.to_vec();
    let key = cmd.idempotency_key.as_str();
    // 1. Commit a "processing" row; a duplicate finds the row and answers from it.
    let inserted = db
        .execute_raw(sql.stmt(
            &sql.keys_insert,
            vec![key.into(), hash.clone().into(), now_ms().into()],
        ))
        .await?
        .rows_affected()
        == 1;
    if !inserted {
        let row = db
            .query_one_raw(sql.stmt(&sql.keys_read, vec![key.into()]))
            .await?
            .ok_or("the idempotency key vanished")?;
        let recorded_hash: Vec<u8> = row.try_get_by_index(0)?;
        let state: i16 = row.try_get_by_index(1)?;
        if recorded_hash != hash {
            return Err("idempotency key reused with other arguments".into());
        }
        if state != 1 {
            return Err("request in flight".into());
        }
        let response: Vec<u8> = row.try_get_by_index(2)?;
        return Ok(serde_json::from_slice(&response)?);
    }
    // 2. The body in its own transaction; on failure, free the key for a retry.
    let tx = db.begin().await?;
    let receipt = match pay_body(&tx, sql, cmd).await {
        Ok(receipt) => receipt,
        Err(e) => {
            let _ = tx.rollback().await;
            db.execute_raw(sql.stmt(&sql.keys_release, vec![key.into()]))
                .await?;
            return Err(e.into());
        }
    };
    tx.commit().await?;
    // 3. Commit the result.
    db.execute_raw(sql.stmt(
        &sql.keys_record,
        vec![serde_json::to_vec(&receipt)?.into(), key.into()],
    ))
    .await?;
    Ok(receipt)
}

/// **idem first** and **idem replay**.
#[idempotent(scope = "bench.pay", key = cmd.idempotency_key, skip(sql))]
pub(crate) async fn pay_idem(
    db: &DatabaseConnection,
    cmd: PayOrder,
    sql: &Sql,
) -> Result<Receipt, idem::Error> {
    pay_body(db, sql, &cmd)
        .await
        .map_err(|e| idem::Error::store("paying the order", e))
}

/// A way of paying; its value is its place in [`Variant::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Variant {
    Bare,
    ThreeCommit,
    IdemFirst,
    IdemReplay,
}

impl Variant {
    /// Every variant, in the order of the first round (ABCD; the next is DCBA).
    pub(crate) const ALL: [Variant; 4] = [
        Variant::Bare,
        Variant::ThreeCommit,
        Variant::IdemFirst,
        Variant::IdemReplay,
    ];

    /// The variants that execute the body (replays write nothing, so they have no throughput).
    pub(crate) const EXECUTING: [Variant; 3] =
        [Variant::Bare, Variant::ThreeCommit, Variant::IdemFirst];

    /// The name in the tables.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::ThreeCommit => "three-commit",
            Self::IdemFirst => "idem first",
            Self::IdemReplay => "idem replay",
        }
    }

    /// The name in the JSON.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::ThreeCommit => "three_commit",
            Self::IdemFirst => "idem_first",
            Self::IdemReplay => "idem_replay",
        }
    }

    /// Whether a call runs the body (and leaves a payment behind).
    pub(crate) fn executes(self) -> bool {
        self != Self::IdemReplay
    }
}

/// One `T` per variant, reached by [`Variant`] (`per[Variant::Bare]`), in [`Variant::ALL`]'s
/// order.
#[derive(Debug, Default, Clone)]
pub(crate) struct PerVariant<T>([T; 4]);

impl<T> PerVariant<T> {
    /// Applies `f` to each variant's value.
    pub(crate) fn map<U>(&self, mut f: impl FnMut(Variant, &T) -> U) -> PerVariant<U> {
        PerVariant(Variant::ALL.map(|v| f(v, &self[v])))
    }
}

impl<T> std::ops::Index<Variant> for PerVariant<T> {
    type Output = T;
    fn index(&self, v: Variant) -> &T {
        &self.0[v as usize]
    }
}

impl<T> std::ops::IndexMut<Variant> for PerVariant<T> {
    fn index_mut(&mut self, v: Variant) -> &mut T {
        &mut self.0[v as usize]
    }
}

pub(crate) async fn call_variant(
    db: &DatabaseConnection,
    sql: &Sql,
    variant: Variant,
    cmd: PayOrder,
) -> Res<Receipt> {
    match variant {
        Variant::Bare => pay_bare(db, sql, &cmd).await,
        Variant::ThreeCommit => pay_three_commit(db, sql, &cmd).await,
        Variant::IdemFirst | Variant::IdemReplay => Ok(pay_idem(db, cmd, sql).await?),
    }
}
