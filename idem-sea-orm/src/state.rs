//! Guarded state transitions on a SeaORM entity: a conditional update inside the handler's
//! transaction, so two different requests can never both move one row.

use std::future::Future;

use idem_core::{EntityTag, Error, IfMatch, StateMachine, Transition, TransitionOutcome};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ActiveEnum, ColumnTrait, ConnectionTrait, EntityTrait, Iterable, PrimaryKeyToColumn,
    QueryFilter, QuerySelect, TryGetable, UpdateMany, Value,
};

use crate::driver::error::store_error;

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

    /// A version column that every applied transition and conditional update increments
    /// (optimistic concurrency for other writers), if the entity has one. It holds an integer
    /// read as `i64` (`BIGINT`); [`EntityTag::from_version`] makes a row's `ETag` from it.
    fn version_column() -> Option<Self::Column> {
        None
    }

    /// Writes `changes` to the row with primary key `id` only if its version satisfies
    /// `if_match`, and advances the version, in one guarded statement
    /// (`UPDATE … SET <changes>, version = version + 1 WHERE id = ? AND version IN (<tags>)`),
    /// so no other writer can slip in between the check and the write:
    /// - the row's version matches (or `If-Match: *` and the row exists): the changes are
    ///   written → [`ConditionalUpdate::Applied`] with the new version;
    /// - no such row → [`ConditionalUpdate::NotFound`], nothing written;
    /// - the row is at another version → [`Error::PreconditionFailed`] with its current tag,
    ///   nothing written.
    ///
    /// `changes` is an update of this entity with its `SET`s only
    /// (`order::Entity::update_many().col_expr(order::Column::Note, Expr::value(note))`);
    /// a filter on it that excludes the row makes the call an [`Error::Store`] naming that
    /// cause. Run it on the handler's transaction, and pass `if_match`
    /// to the `#[idempotent]` function as an argument: a retry of a write that succeeded then
    /// replays its answer instead of failing on the version it moved.
    ///
    /// Needs [`version_column`](Self::version_column); without one it is an [`Error::Store`]
    /// saying so.
    fn update_if_match<C: ConnectionTrait>(
        db: &C,
        id: impl Into<Value> + Send,
        if_match: &IfMatch,
        changes: UpdateMany<Self>,
    ) -> impl Future<Output = Result<ConditionalUpdate, Error>> + Send {
        update_if_match::<Self, C>(db, id.into(), if_match.versions(), changes)
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

/// What [`Stateful::update_if_match`] did when the precondition held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "a conditional update may have found no row: check for `Applied`"]
pub enum ConditionalUpdate {
    /// The row matched and was written; it is now at `version`.
    Applied {
        /// The row's new version ([`EntityTag::from_version`] makes its `ETag`).
        version: i64,
    },
    /// No row has that id: nothing written.
    NotFound,
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
    let current = current
        .map(|value| <E::State as ActiveEnum>::try_from_value(&value))
        .transpose()
        .map_err(|e| store_error("decoding the row's state", e))?;
    transition.unchanged_row(current)
}

/// `accepted`: the versions `If-Match` names (`None` for `*`).
async fn update_if_match<E: Stateful, C: ConnectionTrait>(
    db: &C,
    id: Value,
    accepted: Option<Vec<i64>>,
    changes: UpdateMany<E>,
) -> Result<ConditionalUpdate, Error> {
    let key = primary_key::<E>()?;
    let Some(version) = E::version_column() else {
        return Err(Error::Store {
            message: "conditional updates need a version column: return it from `Stateful::version_column`"
                .to_owned(),
            source: None,
        });
    };
    // A list with no version tag in it (only weak or foreign tags) can match no row: skip
    // the write and only find out whether the row exists.
    if accepted
        .as_ref()
        .is_none_or(|versions| !versions.is_empty())
    {
        let mut update = changes
            .col_expr(version, Expr::col(version).add(1))
            .filter(key.eq(id.clone()));
        if let Some(versions) = &accepted {
            update = update.filter(version.is_in(versions.iter().copied()));
        }
        let updated = update
            .exec(db)
            .await
            .map_err(|e| store_error("writing a conditional update", e))?;
        if updated.rows_affected == 1 {
            // One accepted version: the row moved from it to the next one.
            if let Some([only]) = accepted.as_deref()
                && let Some(version) = only.checked_add(1)
            {
                return Ok(ConditionalUpdate::Applied { version });
            }
            // Our own write holds the row lock: this reads the version it set.
            let now = current_version::<E, C>(db, key, version, id, false).await?;
            return match now {
                Some(version) => Ok(ConditionalUpdate::Applied { version }),
                None => Err(Error::Store {
                    message: "the updated row vanished within its own transaction".to_owned(),
                    source: None,
                }),
            };
        }
    }
    // Nothing matched: a locking read sees the latest committed version even under MySQL's
    // REPEATABLE READ, and keeps it until the transaction ends.
    match current_version::<E, C>(db, key, version, id, true).await? {
        None => Ok(ConditionalUpdate::NotFound),
        Some(current) if accepted.is_none_or(|versions| versions.contains(&current)) => {
            Err(Error::Store {
                message: "the row matches `If-Match` but the conditional update changed nothing: it changed during the update (retry), or a filter on `changes` excludes it".to_owned(),
                source: None,
            })
        }
        Some(current) => Err(Error::PreconditionFailed {
            current: Some(EntityTag::from_version(current)),
        }),
    }
}

async fn current_version<E: EntityTrait, C: ConnectionTrait>(
    db: &C,
    key: E::Column,
    version: E::Column,
    id: Value,
    lock: bool,
) -> Result<Option<i64>, Error> {
    let mut select = E::find().select_only().column(version).filter(key.eq(id));
    if lock {
        select = select.lock_exclusive();
    }
    select
        .into_tuple::<i64>()
        .one(db)
        .await
        .map_err(|e| store_error("reading the row's version", e))
}
