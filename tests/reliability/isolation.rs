//! R7 isolation: principals and scopes never see each other's records. Through both stores
//! (tests/reliability/stores.rs holds the handlers).

use std::collections::BTreeMap;
use std::time::Instant;

use sea_orm::ConnectionTrait;
use serde::{Deserialize, Serialize};

use crate::stores::{
    Case, Conn, call, on_sea_orm, on_sqlx_mysql, on_sqlx_postgres, on_sqlx_sqlite,
    on_tokio_postgres,
};
use crate::support::{Backend, backends, snapshot, stmt, unique};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TenantCmd {
    pub(crate) key: String,
    pub(crate) tenant: String,
    pub(crate) run: String,
    pub(crate) amount: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TenantAnswer {
    pub(crate) tenant: String,
    pub(crate) scope: String,
    pub(crate) execution: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn principals_and_scopes_are_isolated() {
    for b in backends(16).await {
        for case in Case::both(&b, 16).await {
            isolated(&b, &case).await;
        }
    }
}

const TENANTS: usize = 16;
const DUPLICATES: usize = 4;

async fn isolated(b: &Backend, case: &Case) {
    let name = &case.name;
    let started = Instant::now();
    let run = unique("r7");
    let key = format!("{run}-shared");
    let tenant_cmd = |tenant: &str, amount: i64| TenantCmd {
        key: key.clone(),
        tenant: tenant.to_owned(),
        run: run.clone(),
        amount,
    };

    // The same key under 16 principals, 4 concurrent duplicates each, and each tenant
    // with other arguments (a shared record would be KeyReused or a foreign replay).
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TENANTS {
        for _ in 0..DUPLICATES {
            let (case, c) = (case.clone(), tenant_cmd(&format!("tenant-{t}"), t as i64));
            tasks.spawn(async move { (t, call!(case, iso_a(c))) });
        }
    }
    let mut by_tenant: BTreeMap<usize, Vec<TenantAnswer>> = BTreeMap::new();
    for (t, answer) in tasks.join_all().await {
        let answer = answer.unwrap_or_else(|e| panic!("{name} tenant {t}: {e}"));
        assert_eq!(
            answer.tenant,
            format!("tenant-{t}"),
            "{name}: another principal's result"
        );
        by_tenant.entry(t).or_default().push(answer);
    }
    for (t, got) in &by_tenant {
        assert!(
            got.iter().all(|a| a == &got[0]),
            "{name} tenant {t}: one answer"
        );
    }
    let executions: std::collections::BTreeSet<_> = by_tenant
        .values()
        .map(|got| got[0].execution.clone())
        .collect();
    assert_eq!(
        executions.len(),
        TENANTS,
        "{name}: one execution per principal"
    );
    // Replays return each principal's own result.
    for t in [0, TENANTS - 1] {
        let again =
            call!(case, iso_a(tenant_cmd(&format!("tenant-{t}"), t as i64))).expect("replay");
        assert_eq!(again, by_tenant[&t][0], "{name}");
    }

    // The same key and principal in another scope: a new execution, no collision.
    let other = call!(case, iso_b(tenant_cmd("tenant-0", 0))).expect("scope b");
    assert_eq!(other.scope, "rel.iso.b");
    assert_ne!(other.execution, by_tenant[&0][0].execution, "{name}");
    assert_eq!(
        call!(case, iso_b(tenant_cmd("tenant-0", 0))).expect("b replay"),
        other
    );
    assert_eq!(
        call!(case, iso_a(tenant_cmd("tenant-0", 0))).expect("a replay"),
        by_tenant[&0][0]
    );

    // Principal/key boundaries cannot be shifted: (R+"a", "b"+R) and (R+"ab", R) read
    // the same once concatenated (R is the run id).
    let shift = |tenant: String, key: String| TenantCmd {
        key,
        tenant,
        run: run.clone(),
        amount: 0,
    };
    let one = call!(case, iso_a(shift(format!("{run}a"), format!("b{run}")))).expect("one");
    let two = call!(case, iso_a(shift(format!("{run}ab"), run.clone()))).expect("two");
    assert_ne!(one, two, "{name}: shifted boundaries are other records");

    let effects = snapshot(&b.db, "-", &run, None).await;
    let expected = TENANTS + 1 + 2;
    assert_eq!(
        (effects.effects, effects.executions),
        (2 * expected as i64, expected as i64),
        "{name}: {TENANTS} principals + 1 other scope + 2 shifted boundaries"
    );
    let pending: i64 =
        b.db.query_one_raw(stmt(
            &b.db,
            "SELECT COUNT(*) FROM idem_ledger WHERE scope LIKE 'rel.iso.%' AND state = 0",
            vec![],
        ))
        .await
        .expect("pending")
        .expect("a row")
        .try_get_by_index(0)
        .expect("count");
    assert_eq!(pending, 0, "{name}");
    eprintln!(
        "R7 {name}: {TENANTS} principals x {DUPLICATES} concurrent duplicates of one key: \
             {TENANTS} executions, 0 foreign replays; another scope and 2 shifted boundaries: \
             3 more executions; {:.1?}",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------
