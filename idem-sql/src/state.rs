//! Guarded state transitions on a table the application names (sqlx's `StateTable`): the
//! conditional `UPDATE` that moves a row from one state to the next, and the locked read of
//! the state that explains an update that changed nothing. The driver binds the values (the
//! state is the application's own type); the text is here.

use idem_core::Error;

use crate::{Dialect, placeholders};

/// The statements of one guarded transition, in one dialect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guarded {
    /// `UPDATE <table> SET <state> = to[, <version> = <version> + 1] WHERE <key> = id AND
    /// <state> = from`. Binds to, id, from.
    pub update: String,
    /// `SELECT <state> FROM <table> WHERE <key> = id`, locking the row where the database has
    /// row locks (a locking read sees the latest committed state even under MySQL's
    /// REPEATABLE READ; SQLite's claim already holds the write lock). Binds id.
    pub read: String,
}

/// The guarded transition of `table`'s rows, found by `key`, whose state is in `state` and
/// whose `version` column (if any) every applied transition increments. The names are written
/// into the statements as they are (unquoted, as a migration usually creates them), so each
/// must be an identifier (`[A-Za-z_][A-Za-z0-9_]*`, a table may be `schema.table`); any other
/// name is an [`Error::Store`].
pub fn guarded(
    table: &str,
    key: &str,
    state: &str,
    version: Option<&str>,
    dialect: Dialect,
) -> Result<Guarded, Error> {
    let names = [Some(table), Some(key), Some(state), version];
    if let Some(name) = names
        .into_iter()
        .flatten()
        .find(|name| !is_identifier(name))
    {
        return Err(Error::Store {
            message: format!(
                "`{name}` is not a plain SQL identifier: a `StateTable` names its table and columns as `[A-Za-z_][A-Za-z0-9_]*` (a table may be `schema.table`)"
            ),
            source: None,
        });
    }
    let version = version
        .map(|v| format!(", {v} = {v} + 1"))
        .unwrap_or_default();
    let lock = match dialect {
        Dialect::Sqlite => "",
        Dialect::Postgres | Dialect::MySql => " FOR UPDATE",
    };
    Ok(Guarded {
        update: placeholders(
            dialect,
            &format!("UPDATE {table} SET {state} = ?{version} WHERE {key} = ? AND {state} = ?"),
        ),
        read: placeholders(
            dialect,
            &format!("SELECT {state} FROM {table} WHERE {key} = ?{lock}"),
        ),
    })
}

/// Whether `name` is `ident` or `ident.ident`, each `[A-Za-z_][A-Za-z0-9_]*`.
fn is_identifier(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    parts.len() <= 2
        && parts.iter().all(|part| {
            let mut chars = part.chars();
            chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_name_the_columns_and_bind_in_order() {
        let orders = guarded(
            "shop.orders",
            "id",
            "status",
            Some("version"),
            Dialect::Postgres,
        )
        .unwrap();
        assert_eq!(
            orders.update,
            "UPDATE shop.orders SET status = $1, version = version + 1 WHERE id = $2 AND status = $3"
        );
        assert_eq!(
            orders.read,
            "SELECT status FROM shop.orders WHERE id = $1 FOR UPDATE"
        );
        let orders = guarded("orders", "id", "status", None, Dialect::Sqlite).unwrap();
        assert_eq!(
            orders.update,
            "UPDATE orders SET status = ? WHERE id = ? AND status = ?"
        );
        assert_eq!(orders.read, "SELECT status FROM orders WHERE id = ?");
    }

    #[test]
    fn a_name_that_is_not_an_identifier_is_refused() {
        for bad in ["", "orders; DROP TABLE x", "a.b.c", "1st", "o\"rders", "a."] {
            let refused = guarded(bad, "id", "status", None, Dialect::MySql);
            assert!(matches!(refused, Err(Error::Store { .. })), "{bad:?}");
        }
        let bad_version = guarded("orders", "id", "status", Some("v-1"), Dialect::MySql);
        assert!(bad_version.is_err());
    }
}
