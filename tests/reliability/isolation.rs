//! R7 isolation: principals and scopes never see each other's records.

use std::collections::BTreeMap;
use std::time::Instant;

use idem::idempotent;
use sea_orm::{ConnectionTrait, DatabaseConnection};
use serde::{Deserialize, Serialize};

use crate::support::{backends, effect, snapshot, stmt, unique};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct TenantCmd {
    key: String,
    tenant: String,
    run: String,
    amount: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct TenantAnswer {
    tenant: String,
    scope: String,
    execution: String,
}

async fn tenant_body<C: ConnectionTrait>(
    db: &C,
    scope: &str,
    cmd: &TenantCmd,
) -> Result<TenantAnswer, idem::Error> {
    let execution = unique("exec");
    effect(db, &cmd.run, &cmd.key, scope, &execution).await?;
    effect(db, &cmd.run, &cmd.key, scope, &execution).await?;
    Ok(TenantAnswer {
        tenant: cmd.tenant.clone(),
        scope: scope.to_owned(),
        execution,
    })
}

#[idempotent(scope = "rel.iso.a", key = cmd.key, principal = cmd.tenant)]
async fn iso_a(db: &DatabaseConnection, cmd: TenantCmd) -> Result<TenantAnswer, idem::Error> {
    tenant_body(db, "rel.iso.a", &cmd).await
}

#[idempotent(scope = "rel.iso.b", key = cmd.key, principal = cmd.tenant)]
async fn iso_b(db: &DatabaseConnection, cmd: TenantCmd) -> Result<TenantAnswer, idem::Error> {
    tenant_body(db, "rel.iso.b", &cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn principals_and_scopes_are_isolated() {
    const TENANTS: usize = 16;
    const DUPLICATES: usize = 4;
    for b in backends(16).await {
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
                let (db, c) = (b.db.clone(), tenant_cmd(&format!("tenant-{t}"), t as i64));
                tasks.spawn(async move { (t, iso_a(&db, c).await) });
            }
        }
        let mut by_tenant: BTreeMap<usize, Vec<TenantAnswer>> = BTreeMap::new();
        for (t, answer) in tasks.join_all().await {
            let answer = answer.unwrap_or_else(|e| panic!("{} tenant {t}: {e}", b.name));
            assert_eq!(
                answer.tenant,
                format!("tenant-{t}"),
                "{}: another principal's result",
                b.name
            );
            by_tenant.entry(t).or_default().push(answer);
        }
        for (t, got) in &by_tenant {
            assert!(
                got.iter().all(|a| a == &got[0]),
                "{} tenant {t}: one answer",
                b.name
            );
        }
        let executions: std::collections::BTreeSet<_> = by_tenant
            .values()
            .map(|got| got[0].execution.clone())
            .collect();
        assert_eq!(
            executions.len(),
            TENANTS,
            "{}: one execution per principal",
            b.name
        );
        // Replays return each principal's own result.
        for t in [0, TENANTS - 1] {
            let again = iso_a(&b.db, tenant_cmd(&format!("tenant-{t}"), t as i64))
                .await
                .expect("replay");
            assert_eq!(again, by_tenant[&t][0], "{}", b.name);
        }

        // The same key and principal in another scope: a new execution, no collision.
        let other = iso_b(&b.db, tenant_cmd("tenant-0", 0))
            .await
            .expect("scope b");
        assert_eq!(other.scope, "rel.iso.b");
        assert_ne!(other.execution, by_tenant[&0][0].execution, "{}", b.name);
        assert_eq!(
            iso_b(&b.db, tenant_cmd("tenant-0", 0))
                .await
                .expect("b replay"),
            other
        );
        assert_eq!(
            iso_a(&b.db, tenant_cmd("tenant-0", 0))
                .await
                .expect("a replay"),
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
        let one = iso_a(&b.db, shift(format!("{run}a"), format!("b{run}")))
            .await
            .expect("one");
        let two = iso_a(&b.db, shift(format!("{run}ab"), run.clone()))
            .await
            .expect("two");
        assert_ne!(one, two, "{}: shifted boundaries are other records", b.name);

        let effects = snapshot(&b.db, "-", &run, None).await;
        let expected = TENANTS + 1 + 2;
        assert_eq!(
            (effects.effects, effects.executions),
            (2 * expected as i64, expected as i64),
            "{}: {TENANTS} principals + 1 other scope + 2 shifted boundaries",
            b.name
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
        assert_eq!(pending, 0, "{}", b.name);
        eprintln!(
            "R7 {}: {TENANTS} principals x {DUPLICATES} concurrent duplicates of one key: \
             {TENANTS} executions, 0 foreign replays; another scope and 2 shifted boundaries: \
             3 more executions; {:.1?}",
            b.name,
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
