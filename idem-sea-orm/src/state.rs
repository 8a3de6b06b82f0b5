//! Guarded state transitions on a SeaORM entity: a conditional update inside the handler's
//! transaction, so two different requests can never both move one row.

use std::future::Future;

use idem_core::{Error, StateMachine, Transition, TransitionOutcome};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ActiveEnum, ColumnTrait, ConnectionTrait, EntityTrait, Iterable, PrimaryKeyToColumn,
    QueryFilter, QuerySelect, TryGetable, Value,
};

use crate::error::store_error;

/// An entity with a state column (a `#[derive(idem::StateMachine)]` SeaORM `ActiveEnum`) and,
/// optionally, an optimistic version column.
///
/// ```text
/// impl idem::sea_orm::Stateful for order::Entity {
///     type State = OrderStatus;
///     fn state_column() -> order::Column { order::Column::Status }
///     fn version_column() -> Option<order::Column> { Some(order::Column::Version) }
/// }
///
/// // inside an #[idempotent] handler, where `db` is the claim's transaction:
/// let outcome = order::Entity::apply_transition(db, cmd.order_id, transition!(OrderStatus: Pending -> Paid)).await?;
/// ```
pub trait Stateful: EntityTrait {
    /// The state enum.
    type State: StateMachine + ActiveEnum;

    /// The column holding the state.
    fn state_column() -> Self::Column;

    /// A version column that every applied transition increments (optimistic concurrency
    /// for other writers), if the entity has one.
    fn version_column() -> Option<Self::Column> {
        None
    }

    /// Applies `transition` to the row with primary key `id` in one guarded statement
    /// (`UPDATE … SET state = to[, version = version + 1] WHERE id = ? AND state = from`):
    /// - the row is in `from`: it moves to `to` → [`TransitionOutcome::Applied`];
    /// - the row is already in `to`: nothing is written → [`TransitionOutcome::AlreadyApplied`];
    /// - the row is in another state: nothing is written → [`Error::InvalidTransition`] with the
    ///   row's actual state;
    /// - no such row → [`TransitionOutcome::NotFound`].
    ///
    /// Run it on the handler's transaction: concurrent transitions on one row then queue on
    /// the row lock and exactly one of them applies.
    fn apply_transition<C: ConnectionTrait>(
        db: &C,
        id: impl Into<Value> + Send,
        transition: Transition<Self::State>,
    ) -> impl Future<Output = Result<TransitionOutcome, Error>> + Send
    where
        <Self::State as ActiveEnum>::Value: TryGetable + Send,
    {
        apply::<Self, C>(db, id.into(), transition)
    }
}

fn primary_key<E: EntityTrait>() -> Result<E::Column, Error> {
    let mut keys = E::PrimaryKey::iter();
    match (keys.next(), keys.next()) {
        (Some(key), None) => Ok(key.into_column()),
        _ => Err(Error::Store {
            message: "guarded transitions need an entity with a single-column primary key"
                .to_owned(),
            source: None,
        }),
    }
}

async fn apply<E: Stateful, C: ConnectionTrait>(
    db: &C,
    id: Value,
    transition: Transition<E::State>,
) -> Result<TransitionOutcome, Error>
where
    <E::State as ActiveEnum>::Value: TryGetable,
{
    let key = primary_key::<E>()?;
    let state = E::state_column();
    // `save_as` and `eq` cast to the column's type where it is a native enum (PostgreSQL).
    let to: Value = transition.to().into_value().into();
    let from: Value = transition.from().into_value().into();
    let mut update = E::update_many()
        .col_expr(state, state.save_as(Expr::val(to)))
        .filter(key.eq(id.clone()))
        .filter(state.eq(from));
    if let Some(version) = E::version_column() {
        update = update.col_expr(version, Expr::col(version).add(1));
    }
    let updated = update
        .exec(db)
        .await
        .map_err(|e| store_error("applying a state transition", e))?;
    if updated.rows_affected == 1 {
        return Ok(TransitionOutcome::Applied);
    }
    // Nothing matched: read the row's state with a locking read, which sees the latest
    // committed state even under MySQL's REPEATABLE READ.
    let current = E::find()
        .select_only()
        .column(state)
        .filter(key.eq(id))
        .lock_exclusive()
        .into_tuple::<<E::State as ActiveEnum>::Value>()
        .one(db)
        .await
        .map_err(|e| store_error("reading the row's state", e))?;
    let Some(current) = current else {
        return Ok(TransitionOutcome::NotFound);
    };
    let current = <E::State as ActiveEnum>::try_from_value(&current)
        .map_err(|e| store_error("decoding the row's state", e))?;
    match transition.classify(current)? {
        // The row was in `from` yet the update matched nothing: it changed in between.
        TransitionOutcome::Applied => Err(Error::Store {
            message: "the row's state changed during the transition; retry".to_owned(),
            source: None,
        }),
        outcome => Ok(outcome),
    }
}
