//! Declared transitions guarded in the database (issue: state machines), on every backend of
//! the run. Effects are counted in the database.

mod common;

use common::{backends, effects, insert_effect, unique};
use idem::sea_orm::Stateful;
use idem::{ErrorKind, StateMachine, TransitionOutcome, idempotent, transition};
use sea_orm::DatabaseConnection;
use sea_orm::entity::prelude::*;
use serde::Serialize;

#[path = "../examples/shop/model.rs"]
#[allow(unreachable_pub)]
mod model;

use model::{OrderCommand, OrderStatus, cancel_order, order, ship_order};

async fn new_order(db: &DatabaseConnection, run: &str, status: OrderStatus) -> String {
    // Tests creating the tables at once can race on PostgreSQL's catalog: retry.
    for attempt in 1..=5 {
        match model::create_tables(db).await {
            Ok(()) => break,
            Err(e) if attempt == 5 => panic!("cannot create the shop tables: {e}"),
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100 * attempt)).await,
        }
    }
    let id = unique("ord");
    // A Galera node answers a write that lost certification to a concurrent test's write on
    // another row's index entry with 1213 (deadlock), as it does any client: the setup retries.
    for attempt in 1..=5 {
        let written = async {
            model::insert_order(db, &id, run, 1200).await?;
            if status != OrderStatus::Pending {
                order::Entity::update_many()
                    .col_expr(
                        order::Column::Status,
                        sea_orm::sea_query::Expr::value(status),
                    )
                    .filter(order::Column::Id.eq(id.as_str()))
                    .exec(db)
                    .await?;
            }
            Ok::<_, DbErr>(())
        };
        match written.await {
            Ok(()) => break,
            Err(e) if attempt < 5 && e.to_string().contains("Deadlock") => {
                // The insert may have committed before the update lost: start over on a clean row.
                order::Entity::delete_by_id(id.clone()).exec(db).await.ok();
                tokio::time::sleep(std::time::Duration::from_millis(50 * attempt)).await;
            }
            Err(e) => panic!("insert the order at {status:?}: {e}"),
        }
    }
    id
}

async fn order_row(db: &DatabaseConnection, id: &str) -> order::Model {
    order::Entity::find_by_id(id.to_owned())
        .one(db)
        .await
        .expect("read")
        .expect("order exists")
}

#[derive(Debug, Clone, Serialize)]
struct OrderCmd {
    key: String,
    run: String,
    order_id: String,
}

/// Pays an order: the transition guards the payment row.
#[idempotent(scope = "test.sm.pay", key = cmd.key)]
async fn pay(db: &DatabaseConnection, cmd: OrderCmd) -> Result<String, idem::Error> {
    let outcome = order::Entity::apply_transition(
        db,
        cmd.order_id,
        transition!(OrderStatus: Pending -> Paid),
    )
    .await?;
    if outcome.is_applied() {
        insert_effect(db, &cmd.run, "payment", 1).await;
    }
    Ok(format!("{outcome:?}"))
}

/// The shop's own cancel and ship commands, for an order of this test.
fn order_cmd(c: &OrderCmd) -> OrderCommand {
    OrderCommand {
        idempotency_key: c.key.clone(),
        order_id: c.order_id.clone(),
    }
}

async fn cancel(db: &DatabaseConnection, c: OrderCmd) -> Result<String, idem::Error> {
    cancel_order(db, order_cmd(&c)).await
}

async fn ship(db: &DatabaseConnection, c: OrderCmd) -> Result<String, idem::Error> {
    ship_order(db, order_cmd(&c)).await
}

fn cmd(run: &str, order_id: &str) -> OrderCmd {
    OrderCmd {
        key: unique(run),
        run: run.to_owned(),
        order_id: order_id.to_owned(),
    }
}

#[test]
fn the_declaration_is_introspectable() {
    assert!(OrderStatus::can_transition(
        OrderStatus::Pending,
        OrderStatus::Paid
    ));
    assert!(!OrderStatus::can_transition(
        OrderStatus::Cancelled,
        OrderStatus::Paid
    ));
    // `can_transition` is a `const fn`: usable in const assertions.
    const {
        assert!(OrderStatus::can_transition(
            OrderStatus::Paid,
            OrderStatus::Shipped
        ))
    };
    assert_eq!(OrderStatus::transitions().len(), 4);
    assert_eq!(OrderStatus::Refunded.name(), "Refunded");
    let mermaid = OrderStatus::to_mermaid();
    assert!(
        mermaid.contains("[*] --> Pending") && mermaid.contains("Paid --> Refunded"),
        "{mermaid}"
    );
    assert_eq!(
        idem::Transition::new(OrderStatus::Cancelled, OrderStatus::Paid)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidTransition
    );
}

#[tokio::test]
async fn pay_twice_is_already_paid_and_writes_one_payment() {
    for b in backends().await {
        let run = unique("sm-twice");
        let id = new_order(&b.db, &run, OrderStatus::Pending).await;
        assert_eq!(
            pay(&b.db, cmd(&run, &id)).await.expect("pay"),
            "Applied",
            "{}",
            b.name
        );
        assert_eq!(
            pay(&b.db, cmd(&run, &id)).await.expect("pay again"),
            "AlreadyApplied",
            "{}",
            b.name
        );
        assert_eq!(effects(&b.db, &run).await, 1, "{}: one payment", b.name);
        let row = order_row(&b.db, &id).await;
        assert_eq!(
            (row.status, row.version),
            (OrderStatus::Paid, 1),
            "{}",
            b.name
        );
        assert_eq!(
            ship(&b.db, cmd(&run, &id)).await.expect("ship"),
            "Applied",
            "{}",
            b.name
        );
        assert_eq!(order_row(&b.db, &id).await.status, OrderStatus::Shipped);
    }
}

#[tokio::test]
async fn paying_a_cancelled_order_is_refused_and_writes_nothing() {
    for b in backends().await {
        let run = unique("sm-cancelled");
        let id = new_order(&b.db, &run, OrderStatus::Cancelled).await;
        let err = pay(&b.db, cmd(&run, &id)).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidTransition, "{}", b.name);
        assert_eq!(
            err.to_string(),
            "invalid state transition from `Cancelled` to `Paid`"
        );
        assert_eq!(effects(&b.db, &run).await, 0, "{}", b.name);
        let row = order_row(&b.db, &id).await;
        assert_eq!(
            (row.status, row.version),
            (OrderStatus::Cancelled, 0),
            "{}",
            b.name
        );
        let missing = pay(&b.db, cmd(&run, "ord-missing"))
            .await
            .expect("missing row");
        assert_eq!(missing, format!("{:?}", TransitionOutcome::NotFound));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conflicting_transitions_have_exactly_one_winner() {
    for b in backends().await {
        let run = unique("sm-race");
        let id = new_order(&b.db, &run, OrderStatus::Pending).await;
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..32 {
            let (db, c) = (b.db.clone(), cmd(&run, &id));
            tasks.spawn(async move {
                if i % 2 == 0 {
                    ("pay", pay(&db, c).await)
                } else {
                    ("cancel", cancel(&db, c).await)
                }
            });
        }
        let results = tasks.join_all().await;
        let winners: Vec<&str> = results
            .iter()
            .filter(|(_, r)| matches!(r, Ok(s) if s == "Applied"))
            .map(|(who, _)| *who)
            .collect();
        assert_eq!(winners.len(), 1, "{}: {results:?}", b.name);
        for (who, result) in &results {
            match result {
                Ok(s) => assert!(
                    s == "Applied" || s == "AlreadyApplied",
                    "{}: {who} {s}",
                    b.name
                ),
                Err(e) => assert_eq!(
                    e.kind(),
                    ErrorKind::InvalidTransition,
                    "{}: {who} {e}",
                    b.name
                ),
            }
        }
        let row = order_row(&b.db, &id).await;
        assert_eq!(
            row.version, 1,
            "{}: the version advanced exactly once",
            b.name
        );
        let expected = if winners[0] == "pay" {
            OrderStatus::Paid
        } else {
            OrderStatus::Cancelled
        };
        assert_eq!(row.status, expected, "{}", b.name);
        assert_eq!(
            effects(&b.db, &run).await,
            i64::from(winners[0] == "pay"),
            "{}",
            b.name
        );
    }
}
